"""Claimers of a rate-limited queue for bench/limits.sh: each claims and completes a job of queue
`paced` in one transaction, and after a claim that took nothing sleeps until the queue's next
start (get_durable_job_queue_next_start), as an external worker should.
Usage: rate_claimers.py <conninfo> <claimers> <seconds>"""
import sys
import threading
import time

import psycopg

conninfo, claimers, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + seconds

CLAIM = """SELECT durable_jobs.complete_durable_job(c.job_id, %(worker)s, c.lease_token)
           FROM durable_jobs.claim_next_durable_job(%(worker)s, ARRAY['paced']) c"""
NEXT_START = """SELECT extract(epoch FROM durable_jobs.get_durable_job_queue_next_start('paced')
                                      - clock_timestamp())::float8"""


def claimer(number):
    with psycopg.connect(conninfo, autocommit=True) as connection:
        worker = f"rate-{number}"
        while time.monotonic() < deadline:
            if connection.execute(CLAIM, {"worker": worker}).fetchone() is None:
                wait = connection.execute(NEXT_START).fetchone()[0]
                if wait and wait > 0:
                    time.sleep(min(wait, 0.5))


threads = [threading.Thread(target=claimer, args=(n,)) for n in range(claimers)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
