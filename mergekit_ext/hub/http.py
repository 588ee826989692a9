"""Bounded Hub requests: every call ``publish`` makes gives up when the Hub stops answering.

huggingface_hub (>= 1.0) sends its requests through one shared httpx client built by a
factory (``huggingface_hub.set_client_factory``) with no timeout (``timeout=None``): an
endpoint that accepts the connection and never answers (a proxy, a firewall, a stuck
server) holds ``create_repo`` for ever. While publishing, the client gets a connect bound
and a read bound (the longest silence between two bytes of an answer); the user's own
factory (proxies, certificates) is kept and only its timeout set.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, Optional

import click

LOG = logging.getLogger(__name__)

HUB_TIMEOUT_S = 60.0  # --hub-timeout: seconds without an answer before a request gives up
HUB_CONNECT_TIMEOUT_S = 10.0  # opening the connection, at most (and at most --hub-timeout)
# huggingface_hub retries uploads (http_backoff: 5 retries, waits 1+2+4+8+8 s) but not
# create_repo/create_branch/the commit; the bound of one silent upload request:
HUB_RETRIES = 5
HUB_RETRY_WAITS_S = 23.0

HUB_TIMEOUT_HELP = (
    "Seconds a Hub request may wait for an answer before it fails (default "
    f"{HUB_TIMEOUT_S:g}; connecting at most {HUB_CONNECT_TIMEOUT_S:g}). A Hub that never "
    "answers fails `publish` within SECONDS when creating the repository (plus at most 3 s "
    "for huggingface_hub's own daily check), and within "
    f"{HUB_RETRIES + 1}×SECONDS+{HUB_RETRY_WAITS_S:g} s per file when uploading "
    "(huggingface_hub retries uploads)"
)


def check_hub_timeout(seconds: float) -> float:
    if not math.isfinite(seconds) or seconds <= 0:
        raise click.BadParameter(
            f"must be a finite number of seconds > 0; got {seconds!r}", param_hint="'--hub-timeout'"
        )
    return float(seconds)


def hub_timeout_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--hub-timeout SECONDS`` (the same option on ``publish`` and ``run --push-to-hub``)."""
    return click.option(
        "--hub-timeout",
        type=float,
        default=HUB_TIMEOUT_S,
        show_default=False,
        metavar="SECONDS",
        callback=lambda ctx, param, value: check_hub_timeout(value),
        help=HUB_TIMEOUT_HELP,
    )(f)


@contextlib.contextmanager
def bounded_hub_requests(seconds: Optional[float] = None) -> Iterator[float]:
    """While inside, every request of huggingface_hub's shared client is bounded.

    Args:
        seconds: the read (and write/pool) bound; connecting takes at most
            ``min(seconds, HUB_CONNECT_TIMEOUT_S)``. Default :data:`HUB_TIMEOUT_S`.

    Yields:
        The bound in seconds.
    """
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    bound = float(seconds if seconds is not None else HUB_TIMEOUT_S)
    # The factory in use (a user's own, or huggingface_hub's default); no public getter.
    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def bounded_client() -> Any:
        client = previous()
        timeout_type = type(client.timeout)  # httpx.Timeout or httpx2.Timeout
        client.timeout = timeout_type(bound, connect=min(bound, HUB_CONNECT_TIMEOUT_S))
        return client

    set_client_factory(bounded_client)  # closes the shared client: the next one is bounded
    try:
        yield bound
    finally:
        set_client_factory(previous)
