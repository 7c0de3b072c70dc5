"""An external durable_jobs worker in Python (psycopg 3).

Loop: claim a job -> check its payload -> do the slow part of the work while a heartbeat extends
the lease, with no transaction open -> write its effects and complete it in one short
transaction, or fail it with a stable failure code. SIGTERM (or Ctrl-C) stops it cleanly: the
job in hand is finished first, and nothing new is claimed.

    DURABLE_JOBS_DSN="host=localhost port=5433 dbname=postgres user=app_worker password=worker-secret" \
        python3 worker.py

docs/runbook.md, "Roles and privileges", creates that role with what it needs: EXECUTE on
claim_next_durable_job, complete_durable_job, fail_durable_job and extend_durable_job_lease, the
table public.postcards (name text) and INSERT on it. This example's work: kind `postcard` (the
only kind it claims; no handler is registered for it, so the background worker leaves it alone)
inserts payload["name"], a string, into public.postcards, after sleeping payload["seconds"] (a
number, default 0) to stand for slow work. Any other payload fails as `invalid_request`, as in
the Rust example.
"""

import os
import signal
import socket
import threading
import time

import psycopg

LEASE_SECONDS = int(os.environ.get("DURABLE_JOBS_LEASE_SECONDS", "30"))
# The claim takes only these kinds: a worker never touches work it cannot do.
HANDLED_KINDS = ["postcard"]
IDLE_SLEEP = 0.2


class PermanentFailure(Exception):
    """A failure no retry will fix: the job is failed at once."""

    code = "invalid_request"


class TransientFailure(Exception):
    """A failure worth retrying: the job comes back after a backoff while attempts remain."""

    code = "target_unavailable"


def checked(payload):
    """The payload's name and seconds, or PermanentFailure when it is not what a postcard job takes."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise PermanentFailure("a postcard job needs a name, a string")
    seconds = payload.get("seconds", 0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise PermanentFailure("seconds must be a number")
    if payload.get("fail") == "transient":
        raise TransientFailure("the target is down")
    return payload["name"], float(seconds)


def write_effects(conn, name):
    """Runs inside the transaction that completes the job, so its writes commit with it."""
    conn.execute("INSERT INTO public.postcards (name) VALUES (%s)", (name,))


class Heartbeat(threading.Thread):
    """Extends the lease on its own connection every third of the lease while work runs."""

    def __init__(self, dsn, job_id, worker_id, lease_token):
        super().__init__(daemon=True)
        self.args = (job_id, worker_id, lease_token, LEASE_SECONDS)
        self.done = threading.Event()
        self.lost = threading.Event()
        self.conn = psycopg.connect(dsn, autocommit=True)

    def run(self):
        while not self.done.wait(LEASE_SECONDS / 3):
            expiry = self.conn.execute(
                "SELECT durable_jobs.extend_durable_job_lease(%s, %s, %s, %s)", self.args
            ).fetchone()[0]
            if expiry is None:  # stale: the lease is gone; our completion will be refused
                self.lost.set()
                return

    def stop(self):
        self.done.set()
        self.join()
        self.conn.close()


def run_one(dsn, conn, worker_id):
    """Claims and handles one job; returns False when the queue had none ready."""
    row = conn.execute(
        "SELECT job_id, lease_token, job_kind, payload"
        " FROM durable_jobs.claim_next_durable_job(%s, NULL, %s, %s)",
        (worker_id, LEASE_SECONDS, HANDLED_KINDS),
    ).fetchone()
    if row is None:
        return False
    job_id, lease_token, job_kind, payload = row
    heartbeat = Heartbeat(dsn, job_id, worker_id, lease_token)
    heartbeat.start()
    try:
        name, seconds = checked(payload)
        # The slow part, with no transaction open: an open one would hold back vacuum for as long.
        time.sleep(seconds)
        with conn.transaction() as txn:
            write_effects(conn, name)
            outcome = conn.execute(
                "SELECT durable_jobs.complete_durable_job(%s, %s, %s)", (job_id, worker_id, lease_token)
            ).fetchone()[0]
            if outcome == "stale":
                # Someone else owns the job now: drop our effects.
                raise psycopg.Rollback(txn)
    except (PermanentFailure, TransientFailure) as failure:
        conn.execute(
            "SELECT durable_jobs.fail_durable_job(%s, %s, %s, %s, %s)",
            (job_id, worker_id, lease_token, failure.code, str(failure)),
        )
    except Exception as error:
        # The message is kept with the attempt (get_durable_job_attempts): never a secret.
        conn.execute(
            "SELECT durable_jobs.fail_durable_job(%s, %s, %s, 'unexpected_failure', %s)",
            (job_id, worker_id, lease_token, type(error).__name__),
        )
    finally:
        heartbeat.stop()
    return True


def main():
    dsn = os.environ["DURABLE_JOBS_DSN"]
    worker_id = os.environ.get("DURABLE_JOBS_WORKER_ID", f"py-{socket.gethostname()}-{os.getpid()}")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stopping.is_set():
            if not run_one(dsn, conn, worker_id):
                stopping.wait(IDLE_SLEEP)
    print(f"{worker_id} stopped", flush=True)


if __name__ == "__main__":
    main()
