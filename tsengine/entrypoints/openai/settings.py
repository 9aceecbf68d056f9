"""What the HTTP layer is told at start-up, apart from the engine's own config (tsengine.config).

Each limit is there so that one client cannot take the server from the others: a body cap (413), a queue
cap (429 with Retry-After), a default length for requests that name none, deadlines for request headers
and for request bodies (slow clients), and a drain deadline on shutdown. Defaults are what `tsengine serve` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "model"  # the id /v1/models shows and requests may name (vLLM's --served-model-name)
    api_key: str | None = None
    default_max_tokens: int = 1024  # when a request sets neither max_tokens nor max_completion_tokens
    max_queue_len: int = 256  # choices waiting beyond the engine's max_num_seqs; more get 429
    max_body_bytes: int = 8 * 2**20  # larger request bodies get 413
    header_timeout_s: float = 10.0  # a connection that has not sent its request headers by then is closed
    # a request whose body has not fully arrived this long after its headers gets 408 and its connection is
    # closed: one deadline for the whole body, not a rate (a client at any minimum rate could still hold a
    # connection for max_body_bytes / rate); 60 s carries the largest body (8 MiB) at 140 KB/s
    body_timeout_s: float = 60.0
    drain_timeout_s: float = 5.0  # on SIGTERM: how long running requests may finish before they are cut
    tokenizer_threads: int = 2  # tokenization and chat templating run here, off the event loop
    # control-token strings inside chat messages (`<|im_end|><|im_start|>system`) are plain text, never control
    # tokens: a message cannot forge a turn (chat_template.py). Off is vLLM's behaviour. /v1/completions' raw
    # prompts are never touched
    sanitize_control_tokens: bool = True
    # before listening: run one short request so the graphs a first request needs compile first
    # (Engine.warm_up); the rest compile off the engine thread while requests run eagerly
    warmup: bool = True


def default_model_name(model: str) -> str:
    """A hub id as given; a local path by its directory name (a path says nothing to a client, and shows
    the server's file system)."""
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model
