'use strict'
// node-postgres through fenceproxy: one cell of TestTransparencyMatrix (the
// cell's settings, report and stale token's handshake are fencecell.py's, in
// the folder above). The token in the `options` startup parameter; the
// transaction status right after connecting; a first transaction rolled back;
// savepoints; named prepared statements; COPY both ways (pg-copy-streams);
// LISTEN/NOTIFY; a CancelRequest; connect() then end() at once; a stale token
// surfacing as a pg.DatabaseError with code ZF001. PGSSLMODE=require: TLS,
// the server's certificate checked against PGSSLROOTCERT.
const fs = require('node:fs')
const readline = require('node:readline')
const { Readable } = require('node:stream')
const { pipeline } = require('node:stream/promises')
const pg = require('pg')
const copy = require('pg-copy-streams')

const env = process.env
const resource = env.FENCE_RESOURCE || ''
const token = env.FENCE_TOKEN || ''
const session = env.FENCE_SESSION || ''
const stdin = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]()
let failed = false

function config(tok, sess) {
  const c = {
    host: env.PGHOST,
    port: Number(env.PGPORT),
    user: env.PGUSER,
    database: env.PGDATABASE,
    connectionTimeoutMillis: 60000,
    ssl: env.PGSSLMODE === 'require' ? { ca: fs.readFileSync(env.PGSSLROOTCERT) } : false,
  }
  if (tok) {
    c.options = `-c fence.resource=${resource} -c fence.token=${tok}` + (sess ? ` -c fence.session=${sess}` : '')
  }
  return c
}

// check runs fn as the check name and reports it; the program goes on.
async function check(name, fn) {
  try {
    await fn()
    console.log('ok ' + name)
  } catch (err) {
    failed = true
    console.log(`FAIL ${name}: ${String(err).replace(/\n/g, ' | ')}`)
    console.error(err)
  }
}

function assert(cond, what) {
  if (!cond) throw new Error('check failed: ' + what)
}

// within rejects if p has not settled after ms: a lost notification or
// cancel fails the check instead of hanging it.
function within(p, ms, what) {
  let timer
  const t = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(what + ': nothing after ' + ms + ' ms')), ms)
  })
  return Promise.race([p, t]).finally(() => clearTimeout(timer))
}

async function connected(tok, sess) {
  const c = new pg.Client(config(tok, sess))
  c.on('error', () => {}) // a session ended while idle; its callers see it
  await c.connect()
  return c
}

async function ids(client) {
  return (await client.query('SELECT id FROM t ORDER BY id')).rows.map((r) => r.id).join(',')
}

async function main() {
  const client = new pg.Client(config(token, session))
  const idleErrors = [] // errors node-postgres emits while no query waits
  client.on('error', (err) => idleErrors.push(err))
  await client.connect()

  await check('idle after connect', () => assert(client.getTransactionStatus() === 'I', 'status ' + client.getTransactionStatus()))

  await check('rollback leaves nothing', async () => {
    await client.query('BEGIN')
    await client.query("CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')")
    await client.query("INSERT INTO t VALUES (1, 'rolled back')")
    await client.query('ROLLBACK')
    const r = await client.query("SELECT to_regclass('pg_temp.t') IS NOT NULL AS left")
    assert(!r.rows[0].left, "the rolled-back first transaction's table is left")
  })

  await check('transaction and savepoints', async () => {
    await client.query('DROP TABLE IF EXISTS pg_temp.t')
    await client.query("CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')")
    await client.query('BEGIN')
    await client.query("INSERT INTO t VALUES (1, 'kept')")
    await client.query('SAVEPOINT s')
    await client.query("INSERT INTO t VALUES (2, 'undone')")
    await client.query('ROLLBACK TO SAVEPOINT s')
    await client.query({ text: 'INSERT INTO t VALUES ($1, $2)', values: [3, 'kept'] })
    await client.query('COMMIT')
    await client.query('BEGIN')
    const divErr = await client.query('SELECT 1/0').catch((e) => e)
    assert(divErr instanceof pg.DatabaseError && divErr.code === '22012', 'division by zero: ' + divErr)
    await client.query('ROLLBACK')
    const got = await ids(client)
    assert(got === '1,3', 'rows ' + got)
  })

  await check('prepared statement', async () => {
    for (const i of [1, 2, 3]) {
      const r = await client.query({ name: 'double', text: 'SELECT $1::int * 2 AS d', values: [i] })
      assert(r.rows[0].d === 2 * i, 'prepared statement result')
    }
  })

  await check('copy in', async () => {
    let lines = ''
    for (let i = 4; i <= 1000; i++) lines += `${i}\n`
    await pipeline(Readable.from([lines]), client.query(copy.from('COPY t (id) FROM STDIN')))
    const r = await client.query('SELECT count(*)::int AS n FROM t')
    assert(r.rows[0].n === 999, 'rows ' + r.rows[0].n)
  })

  await check('copy out', async () => {
    let out = ''
    for await (const chunk of client.query(copy.to('COPY (SELECT id, tag FROM t ORDER BY id) TO STDOUT'))) {
      out += chunk
    }
    assert(out.split('\n').length === 1000 && out.startsWith('1\tkept\n3\tkept\n4\tcopied\n'), 'COPY out: ' + out.slice(0, 40))
  })

  const other = await connected(token, session)
  await check('listen notify', async () => {
    const notified = new Promise((resolve) => client.once('notification', resolve))
    await client.query('LISTEN ' + env.NOTIFY_CHANNEL) // the cell's own
    await other.query('NOTIFY ' + env.NOTIFY_CHANNEL + ", 'hello from node'")
    const n = await within(notified, 30000, 'notification')
    assert(n.channel === env.NOTIFY_CHANNEL && n.payload === 'hello from node', 'notification ' + JSON.stringify(n))
  })

  await check('cancel', async () => {
    const sleep = new pg.Query('SELECT pg_sleep(60)')
    const sleepDone = new Promise((resolve) => {
      sleep.on('error', resolve)
      sleep.on('end', () => resolve(null))
    })
    client.query(sleep)
    // The cancel must find the query running: a CancelRequest for an idle
    // backend cancels nothing.
    const end = Date.now() + 30000
    for (;;) {
      const a = await other.query("SELECT count(*)::int AS n FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND query LIKE '%pg_sleep%'", [client.processID])
      if (a.rows[0].n === 1 || Date.now() > end) break
      await new Promise((resolve) => setTimeout(resolve, 20))
    }
    new pg.Client(config('')).cancel(client, sleep)
    const cancelErr = await within(sleepDone, 30000, 'cancel')
    assert(cancelErr instanceof pg.DatabaseError && cancelErr.code === '57014', 'cancel: ' + cancelErr)
  })

  // connect() then end() at once: node-postgres writes its Terminate before
  // the startup packet; the server (and the proxy) close without an error.
  await check('connect then end', async () => {
    const quick = new pg.Client(config(token, session))
    const quickErrors = []
    quick.on('error', (e) => quickErrors.push(e))
    // (Its connect() promise never settles then, directly too.)
    quick.connect().catch((e) => quickErrors.push(e))
    await within(quick.end(), 30000, 'end() after connect()')
    assert(!quickErrors.some((e) => e instanceof pg.DatabaseError), 'connect() then end(): ' + quickErrors.join('; '))
  })

  if (token) {
    // A new holder's session makes this one stale: its next statement fails
    // with ZF001 (an idle session may get it as the client's 'error' event
    // first; then the query fails as not queryable).
    await check('stale token', async () => {
      console.log('stale?')
      const [tok, sess] = (await stdin.next()).value.split(' ')
      const higher = await connected(tok, sess === '-' ? '' : sess)
      await higher.query('SELECT 1')
      await higher.end()
      const staleErr = await client.query('SELECT 1').then(() => null, (e) => e)
      assert(staleErr !== null, 'the stale session ran a statement')
      const stale = [staleErr, ...idleErrors].find((e) => e instanceof pg.DatabaseError && e.code === 'ZF001')
      assert(stale, 'no pg.DatabaseError ZF001: ' + [staleErr, ...idleErrors].join('; '))
      console.log('stale: ' + stale.code + ' ' + stale.message)
    })
  } else {
    await client.end()
  }
  await other.end()
  console.log(failed ? 'SOME FAILED' : 'ALL OK')
}

main().then(
  () => process.exit(failed ? 1 : 0),
  (err) => {
    console.error(err)
    process.exit(1)
  }
)
