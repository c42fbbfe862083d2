'use strict'
// Loaded with `node -r` into each of node-postgres's integration test files by driversuites:
// appends a JSON line to $FENCE_SUITE_LOG for every named test of the file's Suite
// (test/suite.js): its outcome, and the connections it configured (a ConnectionParameters,
// which every Client and Pool client builds) to the run's PGHOST and PGPORT with a fencing
// token in the options, without one (the test set its own options), or elsewhere. It changes
// no behaviour: it wraps the test callbacks and the ConnectionParameters constructor only.
const fs = require('fs')
const path = require('path')
const Module = require('module')

const logFile = process.env.FENCE_SUITE_LOG
const file = process.env.FENCE_SUITE_FILE || path.basename(process.argv[1] || '')
const seen = new Map() // test name -> times seen: a name given twice gets " #2"
let current = null // the running test's id
let counts = null // its connections
const outside = { fenced: 0, unfenced: 0, elsewhere: 0 } // connections outside named tests

function record(rec) {
  if (logFile) fs.appendFileSync(logFile, JSON.stringify(rec) + '\n')
}

function note(params) {
  const c = counts || outside
  const here = String(params.host) === process.env.PGHOST && String(params.port) === process.env.PGPORT
  if (!here) c.elsewhere++
  else if (/fence\.token=/.test(params.options || '')) c.fenced++
  else c.unfenced++
}

function wrapSuite(Suite) {
  const run = Suite.prototype.run
  Suite.prototype.run = function (test, cb) {
    const n = (seen.get(test.name) || 0) + 1
    seen.set(test.name, n)
    const id = `${file}::${test.name}${n > 1 ? ' #' + n : ''}`
    if (!test.action) {
      record({ test: id, outcome: 'skipped', message: 'no test function' })
      return run.call(this, test, cb)
    }
    const testRun = test.run
    test.run = function (done) {
      current = id
      counts = { fenced: 0, unfenced: 0, elsewhere: 0 }
      return testRun.call(this, (err) => {
        record({ test: id, outcome: err ? 'failed' : 'passed', message: err ? String(err.stack || err) : '', conns: counts })
        current = null
        done(err)
      })
    }
    return run.call(this, test, cb)
  }
  return Suite
}

// A test that makes the process exit (its Suite's timeout, an uncaught exception) never
// calls back: record it as failed. The file's own record (its exit status, written by
// driversuites) gets the connections made outside named tests.
process.on('exit', (code) => {
  if (current) record({ test: current, outcome: 'failed', message: `the process exited (${code}) during the test`, conns: counts })
  record({ test: file, outcome: 'pending', conns: outside })
})

const wrapped = new Map() // resolved file -> the wrapped exports
const load = Module._load
Module._load = function (request, parent, isMain) {
  const exports = load.apply(this, arguments)
  let resolved
  try {
    resolved = Module._resolveFilename(request, parent, isMain)
  } catch (e) {
    return exports
  }
  if (wrapped.has(resolved)) return wrapped.get(resolved)
  if (resolved.endsWith(path.join('test', 'suite.js'))) {
    wrapped.set(resolved, wrapSuite(exports))
  } else if (resolved.endsWith(path.join('lib', 'connection-parameters.js'))) {
    wrapped.set(
      resolved,
      class extends exports {
        constructor(config) {
          super(config)
          note(this)
        }
      }
    )
  } else {
    return exports
  }
  return wrapped.get(resolved)
}
