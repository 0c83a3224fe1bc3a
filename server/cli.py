"""The `pdserve` command line: serve (one engine), router, launch (a whole deployment), calibrate-kv
(FP8 KV cache scales)."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


MODELS = ("builtin:tiny-story (the trained default), builtin:tiny-llama, builtin:tiny-qwen3-swa, or a Hugging Face "
          "model directory (nothing is downloaded)")
START = """first steps:
  pdserve launch configs/disagg.yaml    a router on :8000 in front of a context and a generation server
  pdserve serve builtin:tiny-story      one server on :8000 that runs both phases
Then POST OpenAI requests to http://127.0.0.1:8000/v1/completions or /v1/chat/completions.
`pdserve COMMAND --help` describes each command."""
SERVE = """Runs one server with the OpenAI API until Ctrl-C (stops at once) or SIGTERM (drains first); both
exit with 0. It prints `pdserve: NAME listening on URL (...)` once it serves. A port in use ends it at
once, with exit code 1.
examples:
  pdserve serve builtin:tiny-story --port 8000
  pdserve serve --config configs/disagg.yaml --server generation-0
    (one server of a deployment: `pdserve launch` prints the whole command, its token file included)"""
LAUNCH = """Starts every server of CONFIG, then its router, each a process of its own with its log in the log dir,
and prints a line per server as it listens, then `ready: URL`. It restarts a server that dies (`restart:`
in the YAML). Ctrl-C or SIGTERM drains and stops everything (exit code 0). A port of the deployment that
is in use stops it before anything starts (exit code 1), naming the port and its server."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Serve LLMs with disaggregated prefill and decode.",
                                     epilog=START, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(commands)
    router = commands.add_parser("router", help="run the router of a deployment YAML alone (`launch` starts it "
                                 "for you)", description="Runs the router of a deployment whose servers run already "
                                 "(`pdserve launch` starts both). Ctrl-C stops it, with exit code 0.")
    router.add_argument("--config", required=True, help="deployment YAML (see configs/)")
    _launch_parser(commands)
    ray = commands.add_parser("ray", help="a deployment that `pdserve launch --ray` started: status, down")
    ray.add_argument("action", choices=["status", "down"], help="status: its actors; down: stop it")
    ray.add_argument("name", help="the deployment's name (`launch --name`, default the YAML's file name)")
    ray.add_argument("--address", default="auto", help="the Ray cluster (default auto)")
    ray.add_argument("--namespace", default="pdserve", help="the Ray namespace (default pdserve)")
    calibrate = commands.add_parser("calibrate-kv", help="measure per-layer FP8 KV cache scales on sample text")
    calibrate.add_argument("model", help=MODELS)
    calibrate.add_argument("--out", required=True, help="the scales file to write (kv_cache_config.scales names it)")
    calibrate.add_argument("--text", action="append", default=[], help="a sample text file (repeatable); "
                           "default: the prose of Python's language reference")
    calibrate.add_argument("--max-tokens", type=int, default=65536, help="sample tokens used at most")
    calibrate.add_argument("--seq-len", type=int, default=2048, help="tokens prefilled at once")
    calibrate.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    calibrate.add_argument("--dtype", default="auto", help="the model's dtype while measuring (auto: bfloat16 on "
                           "CUDA, float32 on a CPU)")
    return parser


def _serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="run one server (OpenAI API): aggregated, or a deployment's context "
                                "or generation server", description=SERVE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("model", nargs="?", help=MODELS)
    serve.add_argument("--config", help="server YAML (model, hostname, port, kv_cache_config, limits), or with "
                       "--server a deployment YAML")
    serve.add_argument("--role", choices=["aggregated", "context", "generation"], help="default: aggregated "
                       "(both phases). A context or generation server needs its deployment's peers and token: "
                       "run one with --config DEPLOYMENT.yaml --server NAME")
    serve.add_argument("--server", help="with --config DEPLOYMENT.yaml: the server of it to run (context-0, "
                       "generation-1, aggregated-0: role and index in the file, as `pdserve launch` names them)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--max-seq-len", type=int, help="longest prompt + output in tokens (default 2048)")
    serve.add_argument("--max-batch-size", type=int, help="most requests in one step (default 64)")
    serve.add_argument("--max-num-tokens", type=int, help="most tokens in one step (default 2048)")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                       help="the model's dtype (default auto: bfloat16 on CUDA, float32 on a CPU)")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto: CUDA if present, else the CPU")
    serve.add_argument("--quantization", choices=["fp8"],
                       help="fp8: the linear layers' weights in FP8, quantized at load (docs/FP8.md)")
    serve.add_argument("--engine-process", choices=["auto", "true", "false"],
                       help="run the engine in a process of its own (default auto: on CUDA only)")
    serve.add_argument("--kv-cache-dtype", choices=["auto", "fp8"],
                       help="kv_cache_config.dtype: the model's dtype (auto) or FP8 e4m3 (docs/FP8.md)")


def _launch_parser(commands) -> None:
    launch = commands.add_parser("launch", help="start a whole deployment (router and servers) from one YAML",
                                 description=LAUNCH, formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_argument("config", help="deployment YAML (see configs/)")
    launch.add_argument("--log-dir", help="where each process's log goes (default: a private temporary directory, "
                        "removed when the launch stops cleanly; under --ray, the same path on each node, default "
                        "<tmp>/pdserve-ray/NAME)")
    launch.add_argument("--ray", metavar="ADDRESS", help="run every server and the router as Ray actors on the "
                        "cluster at ADDRESS (auto, or host:port); needs the ray extra (pip install 'pdserve[ray]', "
                        "or -e '.[ray]' in the source tree)")
    launch.add_argument("--name", help="with --ray: the deployment's name, its actors' prefix (default: the file's "
                        "name without .yaml)")
    launch.add_argument("--namespace", default="pdserve", help="with --ray: the Ray namespace (default pdserve)")
    launch.add_argument("--detach", action="store_true", help="with --ray: return once it serves, leaving it "
                        "running (`pdserve ray down NAME` stops it)")
    launch.add_argument("--placement-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="with --ray: how long to wait for the cluster to place every server")


def _serve(args: argparse.Namespace) -> int:
    from server.config.schema import ConfigError, load_server, load_server_config, server_config_from_dict
    from server.deploy.serve import serve

    overrides = {"hostname": args.host, "port": args.port, "max_seq_len": args.max_seq_len,
                 "max_batch_size": args.max_batch_size, "max_num_tokens": args.max_num_tokens,
                 "dtype": args.dtype, "device": args.device, "quantization": args.quantization,
                 "engine_process": {"true": True, "false": False}.get(args.engine_process, args.engine_process),
                 "kv_cache_config": {"dtype": args.kv_cache_dtype} if args.kv_cache_dtype else None}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    role = args.role or "aggregated"
    if args.config:
        if overrides or args.model or (args.server and args.role):
            raise ConfigError("--config cannot be combined with a model or option flags (nor --server with --role)")
        cfg = load_server(args.config, args.server) if args.server else load_server_config(args.config, role)
    elif args.server:
        raise ConfigError("--server needs --config DEPLOYMENT.yaml")
    elif args.model:
        cfg = server_config_from_dict({"model": args.model, **overrides}, "<command line>", role)
    else:
        raise ConfigError("give a model (builtin:tiny-story, the trained default, or a Hugging Face model "
                          "directory) or --config FILE")
    return serve(cfg, args.server, _port_key(args))


def _port_key(args: argparse.Namespace) -> str:
    """What set the port of `pdserve serve`, for the error that it is in use."""
    if args.server:
        from server.config.schema import load_deployment
        from server.deploy.ports import listeners

        keys = [item.key for item in listeners(load_deployment(args.config)) if item.name == args.server]
        return f"{keys[0] if keys else 'its url'} in {args.config}"
    if args.config:
        return f"port in {args.config}"
    return "--port" if args.port is not None else "the default port; choose one with --port"


def _router(args: argparse.Namespace) -> int:
    from server.config.router import SHARED_GPU_ENV
    from server.config.schema import ConfigError, host_port, load_deployment
    from server.deploy.drain import DrainingServer
    from server.deploy.logs import configure_logging
    from server.deploy.ports import bind_or_say
    from server.router.app import create_router_app

    cfg = load_deployment(args.config)
    configure_logging()
    front = cfg.generation_servers if cfg.disaggregated else cfg.aggregated_servers
    if cfg.router.tenant_salt_from_api_key and not cfg.auth_token:
        raise ConfigError(f"{cfg.source}: router.tenant_salt_from_api_key needs the deployment token "
                          "(PDSERVE_AUTH_TOKEN; `pdserve launch` makes one)")
    if (sock := bind_or_say(cfg.host, cfg.port, "router", f"(port in {cfg.source})")) is None:
        return 1
    app = create_router_app(cfg.router_config(shared_gpu=os.environ.get(SHARED_GPU_ENV) == "1"))
    servers = f"{len(cfg.context_servers)} context, {len(front)} generation" if cfg.disaggregated else \
        f"{len(front)} aggregated"
    line = (f"pdserve: router listening on http://{host_port(cfg.host, cfg.port)} (policy {cfg.router.type}, "
            f"{servers} server(s))")
    DrainingServer(app, cfg.host, cfg.port, on_listening=lambda: print(line, flush=True)).run_on(sock)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from server.deploy.launcher import LaunchOptions, launch

    options = LaunchOptions(log_dir=Path(args.log_dir) if args.log_dir else None)
    if args.ray is None:
        if args.detach or args.name:
            raise UsageError("--detach and --name go with --ray")
        return launch(args.config, options)
    from server.deploy.ray.launch import RayOptions, launch_on_ray
    from server.deploy.ray.placement import PlacementError

    ray_options = RayOptions(address=args.ray, name=args.name, namespace=args.namespace, detach=args.detach,
                             placement_timeout_s=args.placement_timeout)
    try:
        return launch_on_ray(args.config, options, ray_options)
    except PlacementError as exc:
        print(f"pdserve launch: {exc}", file=sys.stderr)
        return 1


def _ray(args: argparse.Namespace) -> int:
    from server.deploy.ray.manage import down, status

    return (status if args.action == "status" else down)(args.name, args.address, args.namespace)


def _calibrate_kv(args: argparse.Namespace) -> int:
    from server.models.calibrate_kv import main

    try:
        return main(args)
    except ValueError as exc:  # its own refusals, not only a config's
        raise UsageError(str(exc)) from exc


class UsageError(Exception):
    """A command's refusal: `pdserve COMMAND: message` on stderr, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"serve": _serve, "router": _router, "launch": _launch, "ray": _ray, "calibrate-kv": _calibrate_kv}
    if args.command is None:
        parser.print_help()
        return 0
    from server.config.yaml_io import ConfigError
    from server.deploy.ray import RayMissing

    try:
        return handlers[args.command](args)
    except (ConfigError, RayMissing, UsageError) as exc:
        print(f"pdserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a server took over SIGINT (while importing or loading)
        print(f"pdserve {args.command}: interrupted", file=sys.stderr)
        return 0 if args.command in SERVING_COMMANDS else 130


SERVING_COMMANDS = ("serve", "router", "launch")  # Ctrl-C is how they are meant to end: exit code 0


def run() -> None:
    """The `pdserve` command: `main`, then the process ends without the interpreter's teardown."""
    from server.exit import exit_now

    code = main()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # `--ray`, `ray status|down`: leave the cluster as Ray's atexit would
        ray.shutdown()
    exit_now(code)


if __name__ == "__main__":
    run()
