"""Reading a request's `Resumption` (set when it was re-placed mid-stream): where its stream and
its output pick up. Pure; shared by the router's migration and the workers."""

from __future__ import annotations

from schemas.events import InferenceRequest


def first_seq(request: InferenceRequest) -> int:
    """The sequence number of the first chunk this placement of the request publishes."""
    return request.resumption.next_seq if request.resumption is not None else 0


def output_before(request: InferenceRequest) -> int:
    """Tokens the client received before this placement (they end the request's prompt)."""
    return request.resumption.output_tokens if request.resumption is not None else 0


def prompt_proper(request: InferenceRequest) -> list[int]:
    """The client's prompt, without the output a resumed request carries at its end."""
    return request.prompt_tokens[: len(request.prompt_tokens) - output_before(request)]
