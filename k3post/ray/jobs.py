"""Ray's job client for `k3post submit` (cli/submit.py): connect to a head's dashboard, submit
an entrypoint with its runtime env, follow the logs, wait for the end, report. The Ray layer is
the only package that imports Ray; the CLI decides what to submit.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ray.exceptions import AuthenticationError
from ray.job_submission import JobSubmissionClient

from k3post.config.errors import UserError

ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


@contextmanager
def _address_wins(address: str | None) -> Iterator[None]:
    """Ray lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override an explicit address; an explicit
    --address should win, so hide them while the client is made."""
    saved = {k: os.environ.pop(k) for k in ADDRESS_ENV if address and k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def connect(address: str | None) -> JobSubmissionClient:
    where = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or "a local head"
    try:
        with _address_wins(address):
            return JobSubmissionClient(address)
    except AuthenticationError as err:
        raise UserError(f"the Ray cluster at {where} refused this client ({str(err).splitlines()[0]}). "
                        "Set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or "
                        "RAY_AUTH_TOKEN_PATH (cluster/README.md)") from None
    except ConnectionError as err:
        raise UserError(f"could not reach a Ray dashboard at {where} ({err}). Pass --address "
                        "http://HEAD:8265 (or set RAY_ADDRESS), or start a head: cluster/README.md") from None


def submit(client: JobSubmissionClient, entrypoint: str, runtime_env: dict) -> str:
    try:
        return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    except AuthenticationError as err:
        raise UserError(f"the Ray cluster refused the job ({str(err).splitlines()[0]}); set RAY_AUTH_MODE "
                        "and RAY_AUTH_TOKEN as the cluster has them") from None


async def _tail(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        print(chunk, end="", flush=True)


def follow(client, job_id: str) -> None:
    """Stream the job's logs here until it ends."""
    asyncio.run(_tail(client, job_id))


def wait_for_end(client, job_id: str, poll_s: float = 1.0) -> str:
    """Poll until the job is in a terminal state; returns the status name."""
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status.value
        time.sleep(poll_s)


def report(client, job_id: str, status: str, printed_logs: bool) -> int:
    info = client.get_job_info(job_id)
    if status == "SUCCEEDED":
        print(f"k3post: job {job_id} succeeded")
        return 0
    if not printed_logs:  # the end of the logs says why; the whole is one command away
        tail = client.get_job_logs(job_id).splitlines()[-30:]
        print("\n".join(tail), file=sys.stderr)
    print(f"k3post: job {job_id} {status}: {info.message or ''}".rstrip(), file=sys.stderr)
    return 1


