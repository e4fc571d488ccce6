"""``python -m gateway serve``: load the models, build the app, run uvicorn.

Options come from, lowest precedence first: built-in defaults, a JSON or TOML config file
(``--config``; keys are the flag names, dashes or underscores), then flags on the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tomllib
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import ServerConfig, create_app

GRACEFUL_SHUTDOWN_S = 5  # open streams are cancelled on SIGTERM; this bounds anything that lingers


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/*")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="tokens generated before /health says ready")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--config", default=None, help="JSON or TOML file of option values (flags override it)")


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


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.cli import load  # the CLI owns model flags -> LoadConfig / EngineConfig

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    llm = load(args)
    loaded = llm.loaded
    device = str(loaded.engine.target.device)
    config = ServerConfig(model_name=args.served_model_name or loaded.model_name, api_key=args.api_key,
                          warmup_tokens=args.warmup_tokens, device=device)
    app = create_app(loaded.engine, loaded.checkpoint.tokenizer, loaded.checkpoint.chat_template, config)
    print(f"serving {config.model_name} on http://{args.host}:{args.port}/v1 ({device}); "
          "/health says ready after warm-up", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
