package sqltx

import (
	"strings"

	pg_query "github.com/pganalyze/pg_query_go/v6"
)

// kindOf classifies one top-level statement from its parse tree.
//
// Where PostgreSQL decides at run time (from options or catalog state) whether
// a statement may run in a transaction block, kindOf errs towards NoTxBlock:
// a NoTxBlock statement that could have run in a block is only refused by the
// proxy, while the opposite mistake is caught by PostgreSQL itself (the check
// the proxy adds puts the statement in a block, where it fails). Either way
// nothing commits unchecked.
func kindOf(n *pg_query.Node) Kind {
	switch s := n.GetNode().(type) {
	case *pg_query.Node_TransactionStmt:
		return transactionKind(s.TransactionStmt)
	case *pg_query.Node_CallStmt:
		return Call
	case *pg_query.Node_DoStmt:
		return Do
	case *pg_query.Node_VariableSetStmt:
		return setKind(s.VariableSetStmt)
	case *pg_query.Node_DeallocateStmt:
		return Deallocate
	case *pg_query.Node_CopyStmt:
		c := s.CopyStmt
		if c.GetIsFrom() && !c.GetIsProgram() && c.GetFilename() == "" {
			return CopyIn
		}

	// PreventInTransactionBlock callers in PostgreSQL 15 (see doc.go).
	case *pg_query.Node_VacuumStmt:
		if s.VacuumStmt.GetIsVacuumcmd() { // ANALYZE alone runs in blocks
			return Maintenance
		}
	case *pg_query.Node_DiscardStmt:
		if s.DiscardStmt.GetTarget() == pg_query.DiscardMode_DISCARD_ALL {
			return Maintenance
		}
	case *pg_query.Node_CreatedbStmt, *pg_query.Node_DropdbStmt,
		*pg_query.Node_CreateTableSpaceStmt, *pg_query.Node_DropTableSpaceStmt,
		*pg_query.Node_AlterSystemStmt,
		// The subscription commands refuse blocks depending on options and
		// on the subscription's state (create_slot, refresh, slot_name).
		*pg_query.Node_CreateSubscriptionStmt, *pg_query.Node_AlterSubscriptionStmt,
		*pg_query.Node_DropSubscriptionStmt:
		return NoTxBlock
	case *pg_query.Node_AlterDatabaseStmt: // ALTER DATABASE d SET TABLESPACE t
		if hasDefElem(s.AlterDatabaseStmt.GetOptions(), "tablespace") {
			return NoTxBlock
		}
	case *pg_query.Node_IndexStmt:
		if s.IndexStmt.GetConcurrent() {
			return NoTxBlock
		}
	case *pg_query.Node_DropStmt:
		if s.DropStmt.GetConcurrent() { // only DROP INDEX has CONCURRENTLY
			return NoTxBlock
		}
	case *pg_query.Node_ReindexStmt:
		switch s.ReindexStmt.GetKind() {
		case pg_query.ReindexObjectType_REINDEX_OBJECT_SCHEMA,
			pg_query.ReindexObjectType_REINDEX_OBJECT_SYSTEM,
			pg_query.ReindexObjectType_REINDEX_OBJECT_DATABASE:
			return NoTxBlock
		}
		// REINDEX TABLE CONCURRENTLY t and REINDEX (CONCURRENTLY) TABLE t
		// both put a "concurrently" option in params; (CONCURRENTLY false)
		// is counted too, erring towards NoTxBlock.
		if hasDefElem(s.ReindexStmt.GetParams(), "concurrently") {
			return NoTxBlock
		}
	case *pg_query.Node_ClusterStmt:
		// CLUSTER without a table processes each table in its own
		// transaction. (CLUSTER of a partitioned table is refused too, but
		// that depends on the catalog: PostgreSQL catches it.)
		if s.ClusterStmt.GetRelation() == nil {
			return NoTxBlock
		}
	case *pg_query.Node_AlterTableStmt:
		for _, c := range s.AlterTableStmt.GetCmds() {
			cmd := c.GetAlterTableCmd()
			if cmd.GetSubtype() == pg_query.AlterTableType_AT_DetachPartition &&
				cmd.GetDef().GetPartitionCmd().GetConcurrent() {
				return NoTxBlock
			}
		}
	}
	return Other
}

func transactionKind(t *pg_query.TransactionStmt) Kind {
	switch t.GetKind() {
	case pg_query.TransactionStmtKind_TRANS_STMT_BEGIN, pg_query.TransactionStmtKind_TRANS_STMT_START:
		return Begin
	case pg_query.TransactionStmtKind_TRANS_STMT_COMMIT:
		if t.GetChain() {
			return CommitChain
		}
		return Commit
	case pg_query.TransactionStmtKind_TRANS_STMT_ROLLBACK:
		if t.GetChain() {
			return RollbackChain
		}
		return Rollback
	case pg_query.TransactionStmtKind_TRANS_STMT_PREPARE:
		return PrepareTransaction
	case pg_query.TransactionStmtKind_TRANS_STMT_COMMIT_PREPARED:
		return CommitPrepared
	case pg_query.TransactionStmtKind_TRANS_STMT_ROLLBACK_PREPARED:
		return RollbackPrepared
	case pg_query.TransactionStmtKind_TRANS_STMT_SAVEPOINT:
		return Savepoint
	case pg_query.TransactionStmtKind_TRANS_STMT_RELEASE:
		return Release
	case pg_query.TransactionStmtKind_TRANS_STMT_ROLLBACK_TO:
		return RollbackTo
	}
	// A transaction statement this version does not know: treat it as the
	// most constrained kind, so that the proxy refuses it.
	return NoTxBlock
}

// setKind classifies SET and RESET. Only the two settings that change how
// PostgreSQL lexes later messages matter; see doc.go.
//
// SET ... TO DEFAULT, RESET and RESET ALL return a setting to the value the
// session started with (ALTER ROLE/DATABASE SET only apply at connection
// start). The proxy checks that value from the ParameterStatus messages it
// relays at startup and refuses a session that starts unsafe, so a reset is
// safe and stays Other.
func setKind(s *pg_query.VariableSetStmt) Kind {
	var unsafe Kind
	switch {
	case strings.EqualFold(s.GetName(), "standard_conforming_strings"):
		unsafe = SetStdStrings
	case strings.EqualFold(s.GetName(), "client_encoding"): // also SET NAMES
		unsafe = SetClientEncoding
	default:
		return Other
	}
	switch s.GetKind() {
	case pg_query.VariableSetKind_VAR_SET_DEFAULT, pg_query.VariableSetKind_VAR_RESET,
		pg_query.VariableSetKind_VAR_RESET_ALL:
		return Other
	case pg_query.VariableSetKind_VAR_SET_VALUE:
		args := s.GetArgs()
		if len(args) != 1 {
			return unsafe
		}
		c := args[0].GetAConst()
		if c == nil || c.GetIsnull() {
			return unsafe
		}
		if unsafe == SetStdStrings && constIsTrue(c) {
			return Other
		}
		if unsafe == SetClientEncoding && c.GetSval() != nil && ClientEncodingSafe(c.GetSval().GetSval()) {
			return Other
		}
	}
	// SET ... FROM CURRENT and anything not understood above.
	return unsafe
}

// constIsTrue reports whether PostgreSQL's parse_bool certainly reads the
// constant as true. It accepts a subset of what parse_bool accepts (on, true,
// yes, 1 and the unique prefixes t, tr, tru, y, ye, in any case): a value
// outside the subset is treated as "maybe off", which only costs a refusal.
func constIsTrue(c *pg_query.A_Const) bool {
	switch v := c.GetVal().(type) {
	case *pg_query.A_Const_Boolval:
		return v.Boolval.GetBoolval()
	case *pg_query.A_Const_Ival:
		return v.Ival.GetIval() == 1
	case *pg_query.A_Const_Sval:
		switch strings.ToLower(v.Sval.GetSval()) {
		case "on", "true", "tru", "tr", "t", "yes", "ye", "y", "1":
			return true
		}
	}
	return false
}

func hasDefElem(opts []*pg_query.Node, name string) bool {
	for _, o := range opts {
		if d := o.GetDefElem(); d != nil && strings.EqualFold(d.GetDefname(), name) {
			return true
		}
	}
	return false
}
