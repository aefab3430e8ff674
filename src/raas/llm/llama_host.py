"""``llama-server`` from the prebuilt ``xllamacpp`` wheel: a process that serves llama.cpp's own HTTP server.

``xllamacpp`` embeds llama.cpp's server (the same C++ routes: ``/v1/completions``, ``/tokenize``,
``/apply-template``, ``/health``, ...) in a Python extension and listens on a port when given one. This
script is that process: it takes the ``llama-server`` flags :class:`raas.llm.embedded.EmbeddedServer`
passes, starts the server, and waits for a signal. It imports nothing from raas (it is run as a file with
``python -P``, so the package's own modules never shadow the standard library) and nothing heavier than
``xllamacpp``, so it starts in well under a second.

An unknown flag is an error (exit status 2, with the flag named on stderr): silently dropping one that
changes what the server computes would be worse.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# Values of LLAMA_ARG_REPACK that turn repacking off, as llama.cpp's own argument parser reads them.
_FALSE = {"0", "false", "off", "no", "disabled"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="llama-host", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-c", "--ctx-size", type=int, default=0)
    ap.add_argument("-np", "--parallel", type=int, default=1)
    ap.add_argument("-t", "--threads", type=int, default=-1)
    ap.add_argument("-tb", "--threads-batch", type=int, default=None)
    ap.add_argument("-b", "--batch-size", type=int, default=None)
    ap.add_argument("-ub", "--ubatch-size", type=int, default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--no-webui", "--no-ui", dest="ui", action="store_false", default=True)
    ap.add_argument("--repack", dest="repack", action="store_true", default=None)
    ap.add_argument("--no-repack", dest="repack", action="store_false")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", default=True)
    args = ap.parse_args(argv)
    if args.repack is None:
        args.repack = os.environ.get("LLAMA_ARG_REPACK", "true").strip().lower() not in _FALSE
    return args


def params_from(args: argparse.Namespace) -> object:
    """``xllamacpp.CommonParams`` for the parsed flags (the fields llama.cpp's own parser sets for them)."""
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = args.model
    p.n_ctx = args.ctx_size
    p.n_parallel = args.parallel
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads if args.threads_batch is None else args.threads_batch
    if args.batch_size is not None:
        p.n_batch = args.batch_size
    if args.ubatch_size is not None:
        p.n_ubatch = args.ubatch_size
    p.hostnames = [args.host]
    p.port = args.port
    p.ui = args.ui
    p.warmup = args.warmup
    p.no_extra_bufts = not args.repack  # what llama-server's --no-repack sets
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import xllamacpp
    except ImportError:
        print("llama-host: xllamacpp is not installed: pip install 'raas[embedded]'", file=sys.stderr)
        return 3
    params = params_from(args)
    try:
        server = xllamacpp.Server(params)  # loads the model, then listens; raises when either fails
    except Exception as exc:
        # Named here: llama.cpp's own log line about the model comes from a logging thread that may not
        # have written it before this process exits.
        print(
            f"llama-host: the server did not start with model {args.model}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(f"llama-host: listening on {server.listening_address}", file=sys.stderr, flush=True)
    # Serve until told to stop; SIGTERM and SIGINT end the process with no Python cleanup to wait for.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
