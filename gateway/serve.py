"""``python -m gateway serve``: load the models, build the app, run uvicorn.

Options come from, lowest precedence first: built-in defaults, a JSON or TOML config file
(``--config``; keys are the flag names, dashes or underscores), then flags on the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import signal
import sys
import tomllib
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import uvicorn

from gateway.app import CorsConfig, ServerConfig, create_app
from gateway.audit import AuditConfig
from gateway.engine_proc import ProcessRunner

GRACEFUL_SHUTDOWN_S = 5  # open streams are cancelled on SIGTERM; this bounds anything that lingers


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 exposes the server beyond this machine")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every route but /health and the "
                                                   "read-only stats GETs (/dashboard, /v1/stats[/stream])")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS), as scheme://host[:port], or * for any "
                        "(default: none, no CORS headers)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="let those origins send cookies or HTTP auth (CORS credentials; not with *)")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="generation requests at once before 429 (default: max-running + max-waiting)")
    p.add_argument("--log-prompts", action="store_true", help="put prompt text in the request log lines")
    p.add_argument("--audit-fraction", type=float, default=0.0,
                   help="replay this fraction of speculative greedy requests without speculation, in idle "
                        "capacity, and compare the tokens (0 = off)")
    p.add_argument("--audit-log-prompts", action="store_true", help="put prompt text in audit mismatch log lines")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="tokens generated before /health says ready")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--config", default=None, help="JSON or TOML file of option values (flags override it)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--engine-process", dest="engine_process", action="store_true", default=True,
                       help="run the engine in a process of its own (the default), so that its steps and the "
                            "streams' Python do not share one interpreter lock (gateway/engine_proc.py)")
    where.add_argument("--engine-thread", dest="engine_process", action="store_false",
                       help="run the engine in a thread of the server's process (the audit needs it)")


def read_config(path: str, options: argparse.ArgumentParser) -> dict[str, Any]:
    """A config file as argparse defaults; unknown keys are an error naming them."""
    text = Path(path).expanduser().read_text(encoding="utf-8")
    values = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold one object / table of option values")
    known = set(vars(options.parse_args([]))) - {"config"}
    out = {}
    for key, value in values.items():
        dest = key.replace("-", "_")
        if dest not in known:
            raise ValueError(f"config file {path}: unknown option {key!r}")
        out[dest] = ",".join(map(str, value)) if isinstance(value, list) else value  # lists: tree widths
    return out


def apply_config(args: argparse.Namespace, options: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Re-parse the serve flags with the config file's values as defaults, so explicit flags still win."""
    options.set_defaults(**read_config(args.config, options))
    merged = options.parse_args(argv)
    merged.func, merged.command = args.func, args.command
    return merged


class DrainingServer(uvicorn.Server):
    """uvicorn that tells the app it is draining the moment SIGINT/SIGTERM arrives, so a request that
    still slips in gets 503 instead of starting a generation that shutdown would cut."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_exit()  # a flag write: safe inside a signal handler
        super().handle_exit(sig, frame)


def run_app(app: Any, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``app`` (from ``create_app``) until SIGINT/SIGTERM, then drain: open streams end with an error
    event within the app's grace period, uvicorn waits ``GRACEFUL_SHUTDOWN_S`` at most, the engine stops."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # uvicorn re-raises the signal into the handler it found once it has drained: a drained SIGTERM is a
    # clean exit (status 0), not a kill, and SIGINT's KeyboardInterrupt is caught as uvicorn.run does.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    with contextlib.suppress(KeyboardInterrupt):
        DrainingServer(config, app.state.gateway.drain).run()


def serve_engine(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """Load the models (the engine process's factory with --engine-process): the engine, and what the server
    needs besides it."""
    from gateway.cli import load  # the CLI owns model flags -> LoadConfig / EngineConfig

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    loaded = load(args).loaded
    engine = loaded.engine
    if engine.tokenizer is None:  # structured output walks the tokenizer's vocabulary in the engine
        engine.tokenizer = loaded.checkpoint.tokenizer
    return engine, {"tokenizer": loaded.checkpoint.tokenizer, "chat_template": loaded.checkpoint.chat_template,
                    "model_name": loaded.model_name, "device": device_label(engine.target.device)}


def device_label(device) -> str:
    """The device as /health reports it: a GPU with its name ("cuda:0 (NVIDIA H200)"), so that a benchmark's
    record says which card gave its numbers."""
    if device.type != "cuda":
        return str(device)
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})"


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    audit = AuditConfig(fraction=args.audit_fraction, log_prompts=args.audit_log_prompts)  # checked before loading
    cors = CorsConfig(tuple(args.allowed_origins), args.allow_credentials)  # so is this
    engine, runner = None, None
    if args.engine_process and audit.fraction > 0:  # its replays run between the engine's steps, in its thread
        print("the audit runs the engine in the server's process (--engine-thread)", file=sys.stderr)
    elif args.engine_process:
        runner = ProcessRunner(functools.partial(serve_engine, args))
        tokenizer, chat_template = runner.extras["tokenizer"], runner.extras["chat_template"]
        model_name, device = runner.extras["model_name"], runner.extras["device"]
    else:
        engine, extras = serve_engine(args)
        tokenizer, chat_template, model_name, device = (extras[k] for k in ("tokenizer", "chat_template",
                                                                              "model_name", "device"))
    config = ServerConfig(model_name=args.served_model_name or model_name, api_key=args.api_key,
                          warmup_tokens=args.warmup_tokens, device=device, max_body_bytes=args.max_body_bytes,
                          max_in_flight=args.max_in_flight, log_prompts=args.log_prompts,
                          audit=audit, cors=cors)
    app = create_app(engine, tokenizer, chat_template, config, runner=runner)
    print(f"serving {config.model_name} on http://{args.host}:{args.port}/v1 ({device}); "
          "/health says ready after warm-up", file=sys.stderr)
    run_app(app, args.host, args.port, args.log_level)
    return 0
