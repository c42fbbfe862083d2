"""What the Python programs of TestTransparencyMatrix share: one cell's settings,
its report and the stale token's handshake.

A cell is one driver through one proxy (admission path, relay, TLS or not).
libpq reads PGHOST, PGPORT, PGUSER, PGDATABASE, PGSSLMODE; FENCE_RESOURCE,
FENCE_TOKEN and FENCE_SESSION name the session's token (no FENCE_TOKEN: an
unfenced session). Each check prints "ok <check>" or "FAIL <check>: <why>"
and the program goes on with the next one.

The stale token's handshake: the program prints "stale?" and reads one line,
"<token> <session>" (session "-" for none), from the test, which has made the
lock change hands (or, for a bare resource, picked the next token); the
program connects as that new holder, and its first session's next statement
must fail with ZF001.
"""

import os
import sys
import threading
import time
import traceback

RESOURCE = os.environ.get("FENCE_RESOURCE", "")
TOKEN = os.environ.get("FENCE_TOKEN", "")
SESSION = os.environ.get("FENCE_SESSION", "")
CHANNEL = os.environ["NOTIFY_CHANNEL"]  # the cell's own: cells run side by side in one database
DEADLINE = 30  # seconds for anything that waits on the server
failed = False


def options(token=TOKEN, session=SESSION):
    """The startup options that carry a token ("" for an unfenced session)."""
    if not token:
        return ""
    o = f"-c fence.resource={RESOURCE} -c fence.token={token}"
    if session:
        o += f" -c fence.session={session}"
    return o


def check(name):
    """Runs the decorated function at once as the check name and reports it."""

    def run(fn):
        global failed
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is the check's
            failed = True
            detail = "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " | ")
            print(f"FAIL {name}: {detail}", flush=True)
            traceback.print_exc()
        else:
            print("ok", name, flush=True)
        return fn

    return run


def next_holder():
    """The stale token's handshake: the new holder's startup options."""
    print("stale?", flush=True)
    token, session = sys.stdin.readline().split()
    return options(token, "" if session == "-" else session)


def cancelled(run, running, cancel):
    """Runs run (a statement that sleeps) while a thread calls cancel once running()
    says the statement runs (a CancelRequest for an idle backend cancels nothing);
    returns what run raised."""

    def cancel_when_running():
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            if running():
                cancel()
                return
            time.sleep(0.02)

    canceller = threading.Thread(target=cancel_when_running)
    canceller.start()
    try:
        run()
    except Exception as e:  # noqa: BLE001 - the caller judges it
        return e
    finally:
        canceller.join()
    raise AssertionError("the statement was not cancelled")


def stale(new_holder, run):
    """The stale token: new_holder(options) connects as the new holder and runs a
    statement; then run (a statement of the first session) must raise ZF001, which is
    returned."""
    new_holder(next_holder())
    try:
        run()
    except Exception as e:  # noqa: BLE001 - the caller judges its type
        return e
    raise AssertionError("the stale session ran a statement")


def done():
    print("ALL OK" if not failed else "SOME FAILED", flush=True)
    sys.exit(1 if failed else 0)
