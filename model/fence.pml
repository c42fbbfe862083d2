/*
 * A Promela model of fenceproxy's fencing (mechanism v2: bind, raise, end),
 * failover included, checked by Spin. model/README.md says what it abstracts away and how
 * to run it (make model; make model-quick).
 *
 * One resource. Two leaders (NL), each one process that gets tokens and runs one session at a
 * time through one of two proxies (NP). A primary and a standby; one failover at most.
 *
 * Every action names, in a comment, the SQL function of migrations/ it stands for and the
 * proof obligation it discharges (P1-P7 of migration 4, L1'-L6 of 5 and 8, C1-C5 of 7 and 8);
 * model/check-names.sh checks that every fence.<name> written here exists in the current schema.
 * The failover pieces stand for issue 21's design, marked "issue 21".
 *
 * Switches (spin -D...):
 *   LEASE       tokens from the PostgreSQL lease (fence.lease_acquire) instead of an external
 *               lock service (Consul, etcd, ZooKeeper: grant, expiry, regression).
 *   SYNC        a synchronous standby: a commit that changes fence state reaches the standby
 *               before anyone sees it. Without: an asynchronous standby. A bind's commit wait
 *               for it may be cancelled (D3: the proxy's login timeout, pg_cancel_backend,
 *               statement_timeout): the commit is then visible on the primary only, with a
 *               WARNING to the proxy. The proxy is given no standby to wait for itself (the
 *               synchronous one acknowledges through the commit: docs/failover.md).
 *   NOFAILOVER  no failover.
 * Negative controls, each must give a counterexample:
 *   MUT_EARLY_COMMIT  the raise commits before the backends it ended have exited (no P2 wait).
 *   MUT_V1            version 1: no binding, no end; a check of the token, then the commit.
 *   MUT_ACK_LOCAL     a raise counted as admitted once committed locally, before the standby
 *                     has it (synchronous_commit=local, or async without the wait), then failover;
 *                     with LEASE, the acquisition answered at its local commit.
 *   MUT_NO_ROWLOCK    the bind does not lock the token's row (no P1 with the raise).
 *   MUT_LEASE_REISSUE (with LEASE) schema 9's lease: the acquisition is reported before the
 *                     standby has it, and the bind does not check the holder: after a failover
 *                     the lease issues a generation a second time.
 *   MUT_PROXY_CACHE   (with LEASE; progress) a proxy keeps the highest token of a lost timeline.
 *   MUT_IGNORE_SYNC_WARNING  (with SYNC) the proxy starts the session although its bind's
 *                     commit answered with the WARNING of a cancelled wait (schema 11's proxy).
 *   MUT_NONRAISING_ASYNC     (with SYNC) fence.bind's path that raises nothing commits without
 *                     waiting for the synchronous standby (schema 11's synchronous_commit off).
 */

#ifndef NL
#define NL 2
#endif
#ifndef NP
#define NP 2
#endif
#ifndef MAXTOK
#define MAXTOK 3
#endif
#define NONE 255

/* The fence state of the database, replicated: on the primary (p) and on the standby (s).
 * tok:  fence.tokens.token (the stored token). With LEASE it is also the lease's generation
 *       (fence.lease_acquire raises the token to the generation in the same transaction: L2).
 * hold: the holder of tok. Without LEASE: fence.consul_tokens.holder (C2); with LEASE:
 *       fence.leases.holder.
 * flag: without LEASE: fence.consul_tokens.regression (C1); with LEASE: the lease expired. */
byte ptok, phold = NONE; bool pflag;
byte stok, shold = NONE; bool sflag;
bool standby = 1;          /* a standby exists; the failover promotes it */
byte epoch;                /* the failover bumps it: every backend of the old primary is gone */
byte tl = 1;               /* the timeline */

/* R's row of fence.tokens (P1): FOR UPDATE by a raise (X), FOR SHARE by a bind (S). A shared
 * request queues behind a waiting exclusive one, as in PostgreSQL's lock manager. */
byte rowX = NONE;
byte rowS;
byte rowWantX;

/* One backend per leader at a time (fence.bindings is unlogged: not replicated). */
 bool killed[NL];           /* pg_terminate_backend sent, not yet processed */
byte bound[NL];            /* the token it is bound to, 0 = not bound (or no backend) */
#ifdef PROGRESS
byte ready[NL];            /* ghost: the token of its started session (ReadyForQuery sent) */
#define READY(x)  ready[i] = x
#else
#define READY(x)  skip
#endif

/* The proxies' memory of the highest token seen, and the timeline it was seen on. */
byte cache[NP];
byte ptl[NP];

byte tok[NL];              /* the token each leader believes it holds (0: none) */
#ifndef LEASE
byte lsIdx;                /* the lock service's last token (LockIndex, revision, zxid) */
byte lsHolder = NONE;
bool lsRegressed;          /* ghost: the lock service went back once */
#endif

byte admitted;             /* ghost: the highest token admitted (never lost) */

/* Expiries are bounded: under weak fairness an always-enabled expiry would end every wait
 * for a holder's admission by expiring it, and progress would hold vacuously. */
#ifndef MAXEXP
#define MAXEXP (MAXTOK - 1)
#endif
byte expiries;
byte cancels;              /* commit waits cancelled so far (D3) */

/* A commit that changes fence state: with SYNC it reaches the standby first
 * (P7 + issue 21: fence.commit_durably, synchronous_commit=on whatever the caller set). Used
 * for the lease acquisition and the regression's record, modelled as never cancelled; a
 * bind's commit, raising or not, may be (SYNC_WAIT below). */
#if defined(SYNC) && !defined(MUT_ACK_LOCAL)
#define DURABLE  if :: standby -> stok = ptok; shold = phold; sflag = pflag :: else fi
#else
#define DURABLE  skip
#endif

/* issue 21: a raise counts as admitted only once the standbys a failover may promote have
 * flushed it (P7 extended). With SYNC the commit's acknowledgement is that wait (SYNC_WAIT). */
#define FLUSHED(t)  (!standby || stok >= t)

/* D3, with SYNC: a bind's commit waits for the synchronous standby, which then has everything
 * the primary committed before it (stok = ptok), or the wait is cancelled (cw = 1): committed
 * and visible on the primary only, answered with a WARNING. Cancels are bounded (MAXCANCEL):
 * a fair, always-enabled cancel would refuse every session. The raise's commit
 * (fence.raise_locked through fence.commit_durably) ... */
#ifndef MAXCANCEL
#define MAXCANCEL 1
#endif
#if defined(SYNC) && !defined(MUT_ACK_LOCAL)
#define SYNC_WAIT \
	if :: standby -> stok = ptok; shold = phold; sflag = pflag; cw = 0 \
	   :: standby && cancels < MAXCANCEL -> cw = 1; cancels++ \
	   :: else -> cw = 0 fi
#else
#define SYNC_WAIT  cw = 0
#endif
/* ... and fence.bind's path that raises nothing, through fence.commit_durably whenever
 * synchronous_standby_names is set. */
#if defined(SYNC) && !defined(MUT_NONRAISING_ASYNC)
#define NONRAISING_WAIT  SYNC_WAIT
#else
#define NONRAISING_WAIT  cw = 0
#endif

#define ADMIT(t)  if :: admitted < t -> admitted = t :: else fi

/* fence.notify: the listening proxies hear of a raise when it commits (not when durable). */
#define NOTIFY(t) q = 0; do :: q < NP -> if :: cache[q] < t -> cache[q] = t :: else fi; q++ :: else -> q = 0; break od

/* fence.end_stale (P2): under the row lock, the bound backends of a lower token (or, for
 * fence.consul_depose (C5), of a token up to and including t): signal each ... */
#ifdef MUT_V1
#define SIGNAL(cond)  skip
#else
#define SIGNAL(cond) \
	atomic { j = 0; do \
	:: j < NL -> if :: j != i && bound[j] > 0 && (cond) -> v[j] = 1; killed[j] = 1 :: else fi; j++ \
	:: else -> j = 0; break od }
#endif
/* ... and wait until each has exited (its binding's backend is gone from pg_stat_activity). */
#if defined(MUT_EARLY_COMMIT) || defined(MUT_V1)
#define AWAIT_EXIT  skip
#else
#define AWAIT_EXIT  atomic { (!v[0] || bound[0] == 0) && (!v[1] || bound[1] == 0) -> v[0] = 0; v[1] = 0 }
#endif

/* The two safety properties, asserted where they can first break. */
#define ASSERT_COMMIT  assert(t >= admitted)        /* no commit under t after t' > t admitted */
#define ASSERT_ONE_HOLDER  assert(bound[1-i] != t)  /* one token, one live holder */

#ifdef LEASE
#define REFUSED_SHARED  (ptok > t)
#ifdef MUT_LEASE_REISSUE
#define LEASE_REFUSES  (t > ptok || (t == ptok && pflag))
#else
#define LEASE_REFUSES  (t > ptok || (t == ptok && (pflag || phold != i)))
#endif
#else
#define REFUSED_SHARED  (ptok > t || pflag)
#endif

proctype Leader(byte i)
{
	byte t, p, e, j, q;
	bool v[NL];
	bool cw;                   /* the bind's commit wait was cancelled: a WARNING (D3) */

idle:
	atomic { t = 0; p = 0; e = 0; j = 0; q = 0; v[0] = 0; v[1] = 0; cw = 0 }
end_idle:
	if
#ifdef LEASE
	/* fence.lease_acquire (L1', L2): only by a leader whose own session is gone (a model
	 * restriction: its lock client and its session are this one process). */
	::  (phold == NONE || pflag) && ptok < MAXTOK -> goto acquire
#endif
	:: tok[i] > 0 -> goto connect
	fi;

#ifdef LEASE
acquire:
	e = epoch;
	{
		rowWantX++;
		/* fence.raise_locked (P1): FOR UPDATE; the lease's own row serializes acquisitions (L1') */
		atomic { rowX == NONE && rowS == 0 -> rowX = i; rowWantX-- }
		if
		:: (phold != NONE && !pflag) || ptok >= MAXTOK -> rowX = NONE; goto idle   /* L1': held */
		:: else -> t = ptok + 1                      /* L2: greatest(generation, token) + 1 */
		fi;
		SIGNAL(bound[j] < t);                        /* fence.end_stale (P2) */
		AWAIT_EXIT;
		atomic { ptok = t; phold = i; pflag = 0; DURABLE; NOTIFY(t); rowX = NONE }
#if !defined(MUT_LEASE_REISSUE) && !defined(MUT_ACK_LOCAL)
		FLUSHED(t);                                  /* issue 21: reported only once durable */
#endif
		atomic { ADMIT(t); tok[i] = t }
	} unless { epoch != e };
	goto idle;
#endif

connect:
	atomic {
		t = tok[i]; e = epoch;
		if :: p = 0 :: p = 1 fi   /* through either proxy */
	}
	{
		atomic {
			/* The proxy refuses a token below the highest it saw (ZF001 from memory). */
			if
			:: t < cache[p] -> goto gone
			:: else
			fi;
#ifndef LEASE
			/* fence.bind: an unlocked read chooses the lock. fence.consul_admit (C1): a
			 * regression refuses every session. */
			if
			:: pflag -> goto gone
			:: !pflag && (t > ptok || (t == ptok && phold != i)) -> goto xpath
			:: else
			fi
#endif
		}
spath:
		/* fence.bind (P1): FOR SHARE, waits for a raise in flight, then reads its token */
#ifdef MUT_NO_ROWLOCK
		skip;
#else
		atomic { rowX == NONE && rowWantX == 0 -> rowS++ }
#endif
		atomic {
#ifndef LEASE
			if
			:: !pflag && (t > ptok || (t == ptok && phold != i)) ->
				/* changed since the unlocked read: take the exclusive path */
#ifndef MUT_NO_ROWLOCK
				rowS--;
#endif
				goto xpath
			:: else
			fi;
#else
			/* fence.bind (L6): ZF002 above the generation, ZF006 once expired; issue 21:
			 * the holder's identity is checked (ZF009-like) */
			if
			:: LEASE_REFUSES ->
#ifndef MUT_NO_ROWLOCK
				rowS--;
#endif
				goto gone
			:: else
			fi;
#endif
		}
		atomic {
			if
			:: REFUSED_SHARED ->         /* fence.bind (P3): ZF001; fence.consul_admit (C1) */
#ifndef MUT_NO_ROWLOCK
				rowS--;
#endif
				goto gone
			:: else
			fi;
			ASSERT_ONE_HOLDER;
			bound[i] = t;                                /* fence.bind: the binding commits */
			NONRAISING_WAIT;                             /* fence.commit_durably (D3) */
#ifndef MUT_NO_ROWLOCK
			rowS--;
#endif
			if :: cache[p] < ptok -> cache[p] = ptok :: else fi;
			p = 0
		}
		goto admit;

#ifndef LEASE
xpath:
		rowWantX++;
		/* fence.raise_locked (P1): FOR UPDATE, waits for every bind in flight */
		atomic { rowX == NONE && rowS == 0 -> rowX = i; rowWantX-- }
		if
		:: pflag -> rowX = NONE; goto gone                 /* fence.consul_admit (C1) */
		:: !pflag && t == ptok && phold != i ->
			/* fence.consul_admit (C2): one number, two holders: a regression;
			 * fence.consul_depose (C5) ends every backend bound to t or lower first */
			SIGNAL(bound[j] <= t);
			AWAIT_EXIT;
			atomic { pflag = 1; DURABLE; rowX = NONE };
			goto gone
		:: !pflag && t < ptok -> rowX = NONE; goto gone   /* fence.bind (P3): ZF001 */
		:: !pflag && t == ptok && phold == i ->
			/* nothing to raise after all: fence.bind's path that raises nothing,
			 * fence.commit_durably (D3) */
			atomic { ASSERT_ONE_HOLDER; bound[i] = t; NONRAISING_WAIT; rowX = NONE; p = 0 }
		:: !pflag && t > ptok ->
			/* fence.raise_locked: the raise, in the bind's transaction */
			SIGNAL(bound[j] < t);                      /* fence.end_stale (P2) */
			AWAIT_EXIT;
			atomic {
				/* the raise, the holder's record (C3) and the binding commit together */
				ptok = t; phold = i; SYNC_WAIT; NOTIFY(t);
				ASSERT_ONE_HOLDER;
				bound[i] = t; rowX = NONE;
				if :: cache[p] < t -> cache[p] = t :: else fi;
				p = 0
			}
		fi;
#endif
admit:
#ifdef SYNC
		/* internal/proxy (session.go, D3): the proxy refuses (ZF007) a session whose bind's
		 * COMMIT answered with a WARNING; it closes the connection, the backend exits. */
#ifndef MUT_IGNORE_SYNC_WARNING
		if
		:: cw -> goto exit
		:: else
		fi;
#endif
#elif !defined(MUT_ACK_LOCAL)
		/* issue 21 (internal/proxy's wait for --failover-standbys): the session starts only
		 * once the standby has flushed the bind's commit, and so the raise it rests on */
		if
		:: FLUSHED(t)
		:: killed[i] -> goto exit
		fi;
#endif
		atomic { ADMIT(t); READY(t) };

session:
		/* The bound session runs transactions until it ends or is ended. */
		do
		:: !killed[i] && tok[i] == t ->
#ifdef MUT_V1
			/* version 1 (schemas 1-3): the commit-time check, then the commit */
			if
			:: ptok > t -> goto exit
			:: else
			fi;
#endif
			atomic { ASSERT_COMMIT }
		:: !killed[i] && tok[i] == t -> goto exit             /* the client disconnects */
		:: killed[i] || tok[i] != t ->
			/* ended by a raise: a commit already under way when the signal came
			 * completes, then the backend aborts what is open and exits. Or the leader
			 * got a new token: one last commit of the old session, then it reconnects. */
			if
			:: atomic { ASSERT_COMMIT }
			:: skip
			fi;
			goto exit
		od;
exit:
		atomic { bound[i] = 0; killed[i] = 0; READY(0) }
		goto idle;
gone:
		/* refused: the backend ends without having been bound */
		atomic { killed[i] = 0; READY(0) }
		goto idle
	} unless { epoch != e };
	/* the failover took the backend with the old primary */
	goto idle
}

#ifndef LEASE
/* The lock service: grant (a new token), expiry (the holder may not notice), regression
 * (its sequence goes back once: Consul's LockIndex after a re-created key). */
active proctype LockService()
{
end:
	do
	:: atomic { lsHolder == NONE && lsIdx < MAXTOK -> lsIdx++;
	            if :: lsHolder = 0 :: lsHolder = 1 fi; tok[lsHolder] = lsIdx }
	:: atomic { lsHolder != NONE && expiries < MAXEXP -> lsHolder = NONE; expiries++ }
#ifndef NOREGRESSION
	:: atomic { !lsRegressed && lsHolder == NONE && lsIdx > 0 -> lsIdx--; lsRegressed = 1 }
#endif
	od
}
#else
/* The database's clock: the holder's lease expires (L3), on the primary and, for the same
 * lease, on the standby. */
active proctype Clock()
{
end:
	do
	:: atomic { phold != NONE && !pflag && (expiries < MAXEXP || tok[phold] != ptok) ->
	            /* (beyond the bound: a holder that was never told its generation, its
	             * acquisition's answer lost in the failover, waits for the expiry: L1') */
	            pflag = 1; expiries++;
	            if :: standby && stok == ptok -> sflag = 1 :: else fi }
	od
}
#endif

/* Asynchronous streaming: the standby catches up to the primary's last commit. */
active proctype Replication()
{
end:
	do
	:: atomic { standby && (stok != ptok || shold != phold || sflag != pflag) ->
	            stok = ptok; shold = phold; sflag = pflag }
	od
}

#ifndef NOFAILOVER
/* The failover (issue 21 as measured: immediate stop of the primary, promotion of the
 * standby): what the standby has is what there is; every backend is gone, and with them
 * every row lock; the timeline goes up. */
active proctype Failover()
{
	atomic {
		standby ->
		standby = 0; epoch++; tl++;
#ifdef LEASE
		/* a newer acquisition on the lost timeline means the standby's lease had expired */
		if :: stok < ptok && shold != NONE -> sflag = 1
		   :: stok == ptok && pflag -> sflag = 1
		   :: else fi;
#endif
		ptok = stok; phold = shold; pflag = sflag;
		bound[0] = 0; bound[1] = 0;
		killed[0] = 0; killed[1] = 0;
#ifdef PROGRESS
		ready[0] = 0; ready[1] = 0;
#endif
		rowX = NONE; rowS = 0; rowWantX = 0
	}
}
#endif

/* issue 21: a proxy notices the new timeline (pg_control_checkpoint, pg_is_in_recovery) and
 * re-reads the stored token, dropping what it remembered from the lost timeline. */
proctype Proxy(byte p)
{
#ifndef MUT_PROXY_CACHE
end:
	do
	:: atomic { ptl[p] != tl -> cache[p] = ptok; ptl[p] = tl }
	od
#else
	skip   /* it keeps what it remembered */
#endif
}

init {
	atomic {
		ptl[0] = 1; ptl[1] = 1;
		run Proxy(0); run Proxy(1);
		run Leader(0); run Leader(1)
	}
}

/* Progress: a leader the authority says leads (the lock service's holder, or the lease's
 * unexpired holder) gets a started session, while the lock service and the database are up.
 * Not where it cannot hold: after a lock service regression (C1: the resource fails closed
 * until an operator's fence.reset). Checked with weak fairness (pan -a -f). */
#ifdef PROGRESS
#ifndef LEASE
#define pending (lsHolder != NONE && !lsRegressed && ready[lsHolder] != tok[lsHolder])
#else
#define pending (phold != NONE && !pflag && tok[phold] == ptok && ready[phold] != ptok)
#endif
ltl progress { [] (pending -> <> !pending) }
#endif
