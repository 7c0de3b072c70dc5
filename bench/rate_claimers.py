"""Claimers of a rate-limited queue for bench/limits.sh: each claims and completes a job of queue
`paced` in one transaction, and after a claim that took nothing sleeps until just before the
queue's next start (get_durable_job_queue_next_start), as an external worker should.
Usage: rate_claimers.py <conninfo> <claimers> <seconds>"""
import sys
import multiprocessing
import time

import psycopg

conninfo, claimers, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + seconds

CLAIM = """SELECT durable_jobs.complete_durable_job(c.job_id, %(worker)s, c.lease_token)
           FROM durable_jobs.claim_next_durable_job(%(worker)s, ARRAY['paced']) c"""
NEXT_START = """SELECT extract(epoch FROM durable_jobs.get_durable_job_queue_next_start('paced')
                                      - clock_timestamp())::float8"""


# A claimer wakes this long before the next start and claims again at once until it starts a job
# (or this much more has passed): what a token waits between coming back and being taken is
# lost to the rate, since a token is usable again a period after it was taken.
EARLY = 0.001
# How long a claimer waits when the next start is now but its claim took nothing: another claim
# holds the token until its transaction ends.
BUSY = 0.0002


def claimer(number):
    with psycopg.connect(conninfo, autocommit=True) as connection:
        worker = f"rate-{number}"
        retry_until = 0.0
        while time.monotonic() < deadline:
            if connection.execute(CLAIM, {"worker": worker}).fetchone() is not None:
                continue
            if time.monotonic() < retry_until:
                continue
            wait = connection.execute(NEXT_START).fetchone()[0]
            if wait is None or wait <= 0:
                # A token is back but another claim holds it until its transaction ends.
                time.sleep(BUSY)
                continue
            if wait > EARLY:
                time.sleep(min(wait - EARLY, 0.5))
            retry_until = time.monotonic() + 2 * EARLY


# Processes, not threads: claimers waiting on one interpreter's lock came late to their tokens.
processes = [multiprocessing.Process(target=claimer, args=(n,)) for n in range(claimers)]
for process in processes:
    process.start()
for process in processes:
    process.join()
