"""`rollgate mock-llm` (`python -m rollgate.mock_llm`): serve the mock until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from rollgate.mock_llm.openai_wire import USAGE_CHOICES
from rollgate.mock_llm.server import FLAVORS, MockLLM


def main(argv: list[str] | None = None) -> int:
    """Parses the flags and serves the mock until SIGTERM or SIGINT."""
    import rollgate.mock_llm

    parser = argparse.ArgumentParser(
        prog="rollgate mock-llm", description=rollgate.mock_llm.__doc__
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="delay before the first token"
    )
    parser.add_argument("--token-interval-ms", type=float, default=0.0, help="delay between tokens")
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=0,
        help="tokens in every text answer (0: a short echo of the last user message)",
    )
    parser.add_argument("--model", default="rollgate-mock")
    parser.add_argument("--api-key", default=None, help="require this bearer key (401 otherwise)")
    parser.add_argument(
        "--flavor", choices=FLAVORS, default="vllm", help="which server's wire shapes to speak"
    )
    parser.add_argument(
        "--strict-model", action="store_true", help="404 for any model but --model (like vLLM)"
    )
    parser.add_argument(
        "--usage-choices",
        choices=USAGE_CHOICES,
        default="empty",
        help="the streamed usage chunk's choices: [] (empty), null, or no key (absent)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    mock = MockLLM(
        host=args.host,
        port=args.port,
        latency_ms=args.latency_ms,
        token_interval_ms=args.token_interval_ms,
        model=args.model,
        api_key=args.api_key,
        flavor=args.flavor,
        strict_model=args.strict_model,
        usage_choices=args.usage_choices,
        answer_tokens=args.answer_tokens,
    )

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with mock:
            await stop.wait()

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve())
    except OSError as err:
        # One line saying what to change, as every service says it (no traceback).
        print(
            f"rollgate mock-llm: cannot listen on {args.host}:{args.port} "
            f"({err.strerror or err}): choose another --host or --port",
            file=sys.stderr,
        )
        return 1
    return 0
