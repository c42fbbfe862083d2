'use strict'
// node-postgres through fenceproxy (run by the Go test TestDrivers): a token
// in the `options` startup parameter, prepared statements, transactions,
// COPY (pg-copy-streams), LISTEN/NOTIFY, a CancelRequest, connect() then end()
// at once, and, with FENCE_TOKEN set, a stale token surfacing as a
// pg.DatabaseError with code ZF001. Connection settings come from PGHOST,
// PGPORT, PGUSER, PGDATABASE; FENCE_RESOURCE and FENCE_TOKEN name the token
// (none: an unfenced session). Prints "ok <check>" per check, then "ALL OK".
const { Readable } = require('node:stream')
const { pipeline } = require('node:stream/promises')
const pg = require('pg')
const copy = require('pg-copy-streams')

const resource = process.env.FENCE_RESOURCE || ''
const token = process.env.FENCE_TOKEN || ''

function config(tok) {
  const c = {
    host: process.env.PGHOST,
    port: Number(process.env.PGPORT),
    user: process.env.PGUSER,
    database: process.env.PGDATABASE,
    connectionTimeoutMillis: 60000,
  }
  if (tok) {
    c.options = `-c fence.resource=${resource} -c fence.token=${tok}`
  }
  return c
}

function ok(name) {
  console.log('ok ' + name)
}

function check(cond, what) {
  if (!cond) throw new Error('check failed: ' + what)
}

// within rejects if p has not settled after ms: a lost notification or
// cancel fails the run instead of hanging it.
function within(p, ms, what) {
  let timer
  const t = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(what + ': nothing after ' + ms + ' ms')), ms)
  })
  return Promise.race([p, t]).finally(() => clearTimeout(timer))
}

async function connected(tok) {
  const c = new pg.Client(config(tok))
  c.on('error', () => {}) // a session ended while idle; its callers see it
  await c.connect()
  return c
}

async function main() {
  const client = new pg.Client(config(token))
  const idleErrors = [] // errors node-postgres emits while no query waits
  client.on('error', (err) => idleErrors.push(err))
  await client.connect()
  const r0 = await client.query('SELECT 1 AS one')
  check(r0.rows[0].one === 1, 'SELECT 1')
  ok('connect')

  for (const i of [1, 2, 3]) {
    const r = await client.query({ name: 'double', text: 'SELECT $1::int * 2 AS d', values: [i] })
    check(r.rows[0].d === 2 * i, 'prepared statement result')
  }
  ok('prepared statement')

  await client.query('CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL)')
  await client.query('BEGIN')
  await client.query("INSERT INTO t VALUES (1, 'rolled back')")
  await client.query('ROLLBACK')
  await client.query('BEGIN')
  await client.query({ text: 'INSERT INTO t VALUES ($1, $2)', values: [1, 'kept'] })
  await client.query('COMMIT')
  await client.query('BEGIN')
  const divErr = await client.query('SELECT 1/0').catch((e) => e)
  check(divErr instanceof pg.DatabaseError && divErr.code === '22012', 'division by zero: ' + divErr)
  await client.query('ROLLBACK')
  const r1 = await client.query('SELECT tag FROM t')
  check(r1.rows.length === 1 && r1.rows[0].tag === 'kept', 'transaction: ' + JSON.stringify(r1.rows))
  ok('transaction')

  let lines = ''
  for (let i = 2; i <= 1000; i++) lines += `${i}\trow ${i}\n`
  await pipeline(Readable.from([lines]), client.query(copy.from('COPY t FROM STDIN')))
  let out = ''
  for await (const chunk of client.query(copy.to('COPY (SELECT id, tag FROM t ORDER BY id) TO STDOUT'))) {
    out += chunk
  }
  check(out.split('\n').length === 1001 && out.startsWith('1\tkept\n2\trow 2\n'), 'COPY out: ' + out.slice(0, 40))
  ok('copy')

  const other = await connected(token)
  const notified = new Promise((resolve) => client.once('notification', resolve))
  await client.query('LISTEN node_chan')
  await other.query("NOTIFY node_chan, 'hello from node'")
  const n = await within(notified, 30000, 'notification')
  check(n.channel === 'node_chan' && n.payload === 'hello from node', 'notification ' + JSON.stringify(n))
  ok('listen/notify')

  const sleep = new pg.Query('SELECT pg_sleep(60)')
  const sleepDone = new Promise((resolve) => {
    sleep.on('error', resolve)
    sleep.on('end', () => resolve(null))
  })
  client.query(sleep)
  // The cancel must find the query running: a CancelRequest for an idle
  // backend cancels nothing.
  for (;;) {
    const a = await other.query("SELECT count(*)::int AS n FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND query LIKE '%pg_sleep%'", [client.processID])
    if (a.rows[0].n === 1) break
    await new Promise((resolve) => setTimeout(resolve, 20))
  }
  new pg.Client(config('')).cancel(client, sleep)
  const cancelErr = await within(sleepDone, 30000, 'cancel')
  check(cancelErr instanceof pg.DatabaseError && cancelErr.code === '57014', 'cancel: ' + cancelErr)
  ok('cancel')

  // connect() then end() at once: node-postgres writes its Terminate before
  // the startup packet; the server (and the proxy) close without an error.
  const quick = new pg.Client(config(token))
  const quickErrors = []
  quick.on('error', (e) => quickErrors.push(e))
  // (Its connect() promise never settles then, directly too.)
  quick.connect().catch((e) => quickErrors.push(e))
  await within(quick.end(), 30000, 'end() after connect()')
  check(!quickErrors.some((e) => e instanceof pg.DatabaseError), 'connect() then end(): ' + quickErrors.join('; '))
  ok('connect then end')

  if (token) {
    // A higher token admitted through another session makes this one stale:
    // its next statement fails with ZF001 (an idle session may get it as the
    // client's 'error' event first; then the query fails as not queryable).
    const higher = await connected(String(Number(token) + 1))
    await higher.query('SELECT 1')
    await higher.end()
    const staleErr = await client.query('SELECT 1').then(() => null, (e) => e)
    check(staleErr !== null, 'the stale session ran a statement')
    const stale = [staleErr, ...idleErrors].find((e) => e instanceof pg.DatabaseError && e.code === 'ZF001')
    check(stale, 'no pg.DatabaseError ZF001: ' + [staleErr, ...idleErrors].join('; '))
    console.log('stale: ' + stale.code + ' ' + stale.message)
    ok('stale token')
  } else {
    await client.end()
  }
  await other.end()
  console.log('ALL OK')
}

main().then(
  () => process.exit(0),
  (err) => {
    console.error(err)
    process.exit(1)
  }
)
