"""``python -m spotguard_daemon.simulator PLATFORM [--host H] [--port N] [-o KEY=VALUE ...]``."""

from __future__ import annotations

import argparse
import logging
import sys

from . import PLATFORMS, parse_option, serve
from ._serve import DEFAULT_PORT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spotguard_daemon.simulator",
                                     description="Simulate a cloud metadata service on loopback.")
    parser.add_argument("platform", choices=sorted(PLATFORMS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="platform option, e.g. imdsv1=true, vm_name=vm-3, first_call_delay=5")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    try:
        options = dict(parse_option(text) for text in args.option)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(args.platform, args.host, args.port, **options)
    except (TypeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
