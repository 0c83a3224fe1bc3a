"""Serving under load on the GPU, in one command: the 8B-shaped model, phases in order.

a. engine ceilings (scripts/bench_gpu_load_engine.py, a child process whose GPU memory is freed
   before any server starts): HBM GB/s, b1 TPOT, c=C decode tok/s and step time of the engine;
b. a fresh aggregated server (`pdserve serve`, start-up time): --warm-runs staggered closed-loop runs
   at --warm-concurrency with no warm-up; the first run's server TTFT mean / the last's (<= 1.5);
c. the same server: c=--peak-concurrency output tok/s over the steady window / the engine's
   (>= 0.85), TPOT p50 / the engine's step (<= 1.15); b1 TPOT / (bytes per step / HBM) (<= 1.25);
d. the same server, then router + context + generation on the same GPU (`pdserve launch`): c=C tok/s
   disagg / agg (>= 0.95), TTFT p50 disagg / agg (<= 1.5); the mixed workload (long prompts arriving
   at --long-rate while --mixed-concurrency streams decode): background TPOT p99 disagg / agg
   (<= 0.7); goodput within the SLO of both;
e. a fresh aggregated server under `pdserve launch`: its server SIGKILLed, restarted by the launcher
   (restart time); the first run's server TTFT mean / the second's (<= 1.5);
burst. on the same deployment: its first server (fresh: `pdserve serve`, started by the launcher)
   and, after the phase e runs, a server SIGKILLed and restarted again, each hit by --burst-runs
   closed-loop runs of --burst-requests requests at --burst-concurrency whose streams all start at
   once (no ramp); run 1's server TTFT mean / the last run's (<= 1.5), and the client's;
f. with --with-extras: the KV handoff / context leg of --handoff-len prompts on the pair, and the
   prefill TFLOP/s of that length in phase a.

Every phase prints `{"phase": ..., "elapsed_s": ...}`, every figure one JSON line, the end a SUMMARY
line; a phase that fails prints its error and the next one runs. Under --out: records.jsonl (a
`load` record per group of runs, a `gpu-load` record of every figure), report.md, plots/ (3 PNGs).
Every size is a flag, so that the run can be trimmed to the device time there is.

    python scripts/bench_gpu_load.py --workdir /tmp/bench-gpu --out $OUT [--skip e,burst] [--with-extras]
    python scripts/bench_gpu_load.py --model builtin:tiny-llama --max-seq-len 2048 ... tiny sizes   # a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml
from bench_gpu_load_session import Session, closed_plan, mixed_plan

from pdserve_bench.launch import ServerUnderTest, server_pid, server_urls, wait_for_health
from pdserve_bench.load_client import default_procs
from pdserve_bench.load_target import LoadTarget, started_target
from pdserve_bench.measure import model_vocab, warm_up
from pdserve_bench.record import RecordWriter, RunContext

SCRIPTS = Path(__file__).resolve().parent
RESTART_TIMEOUT_S = 300.0


def engine_phase(s: Session, args: argparse.Namespace) -> str:
    """Phase a in a child process; returns the model the servers serve."""
    sizes = {"layers": args.layers, "max-seq-len": args.max_seq_len, "max-num-tokens": args.max_num_tokens,
             "max-batch-size": args.max_batch_size, "input-len": args.input_len, "output-len": args.output_len,
             "concurrency": args.peak_concurrency, "prefill-len": args.handoff_len if args.with_extras else 0}
    argv = [sys.executable, str(SCRIPTS / "bench_gpu_load_engine.py"),
            "--model-dir", str(args.workdir / f"llama8b-text-{args.layers}")]
    argv += [x for name, value in sizes.items() for x in (f"--{name}", str(value))]
    argv += (["--model", args.model] if args.model else []) + (["--build-only"] if "a" in args.skip else [])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.engine_timeout_s,
                          env={**os.environ, **s.server_env})
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("ENGINE ")), None)
    if line is None:
        raise RuntimeError(f"engine phase failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    s.engine = json.loads(line[len("ENGINE "):])
    s.emit("engine", **s.engine)
    return s.engine["model"]


def deployment_file(args: argparse.Namespace, model: str, kind: str) -> Path:
    """The aggregated, disaggregated or restart deployment (ports are replaced by free ones)."""
    cfg: dict = {"model": model, "hostname": "127.0.0.1", "port": 18950, "max_seq_len": args.max_seq_len,
                 "max_num_tokens": args.max_num_tokens, "max_batch_size": args.max_batch_size,
                 "kv_cache_config": {"tokens_per_block": 32}}
    if kind.startswith("disagg"):
        cfg["cache_transceiver_config"] = {"kv_transfer_timeout_ms": 120000}
        cfg["context_servers"] = {"num_instances": 1, "urls": ["127.0.0.1:18951"]}
        cfg["generation_servers"] = {"num_instances": 1, "urls": ["127.0.0.1:18952"]}
    if kind == "disagg":  # the pair time-slicing the GPU
        cfg["gpu_share"] = "off"
    if kind in ("disagg-mps", "disagg-split"):  # the launcher runs the pair under its CUDA MPS daemon
        cfg["context_servers"]["gpu_share"] = args.context_sm_pct
    if kind == "disagg-split":  # every prompt through the context server (no local short prefills)
        cfg["router"] = {"conditional": {}}
    if kind == "restart":
        cfg["restart"] = {"max_quick_deaths": 3, "backoff_s": 1.0, "quick_s": 60.0}
    path = args.workdir / f"load-{kind}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def start(s: Session, stack: ExitStack, server: ServerUnderTest, name: str) -> LoadTarget:
    stack.enter_context(server)
    target = started_target(name, server)
    s.emit(f"{name}_startup", startup_s=target.startup_s)
    return target


def fresh_phase(s: Session, args: argparse.Namespace, target: LoadTarget) -> None:
    plans = [closed_plan(args, args.warm_concurrency, s.seed(), duration_s=args.warm_duration)
             for _ in range(args.warm_runs)]
    runs = s.runs(target, "fresh", "first runs", plans)
    s.goal("b_fresh_server_ttft", f"b: fresh server, server TTFT mean, run 1 / run {len(runs)}",
           runs[0]["server_ttft_mean_ms"], runs[-1]["server_ttft_mean_ms"], 1.5, False)
    s.goal("b_fresh_client_ttft", f"b: fresh server, client TTFT mean, run 1 / run {len(runs)}",
           runs[0]["ttft_mean_ms"], runs[-1]["ttft_mean_ms"], 1.5, False)


def peak_phase(s: Session, args: argparse.Namespace, target: LoadTarget) -> None:
    """c: the HTTP figures against the engine's."""
    peak = s.runs(target, "agg", "peak", [closed_plan(args, args.peak_concurrency, s.seed(),
                                                   duration_s=args.peak_duration)])[0]
    e = s.engine
    s.goal("c_http_vs_engine_tok_s", "c: HTTP steady output tok/s / engine", peak["steady_output_tok_s"],
           e.get("engine_tok_s"), 0.85, True)
    s.goal("c_http_tpot_vs_engine_step", "c: HTTP TPOT p50 / engine step", peak["tpot_p50_ms"],
           e.get("engine_step_ms"), 1.15, False)
    # the same closed loop (arrivals, so mixed prefill+decode steps) driven without HTTP: what HTTP costs
    s.goal("c_http_vs_engine_closed_tok_s", "c: HTTP steady output tok/s / engine, same closed loop",
           peak["steady_output_tok_s"], e.get("engine_closed_tok_s"), 0.85, True)
    s.goal("c_http_tpot_vs_engine_closed_step", "c: HTTP TPOT p50 / engine step, same closed loop",
           peak["tpot_p50_ms"], e.get("engine_closed_step_ms"), 1.15, False)
    b1 = s.runs(target, "agg", "b1", [closed_plan(args, 1, s.seed(), count=args.b1_requests)])[0]
    hbm = e.get("hbm_read_gb_s")
    floor = (e["weight_bytes"] + e["b1_kv_bytes"]) / hbm / 1e6 if hbm and "weight_bytes" in e else None
    s.goal("c_b1_tpot_vs_roofline", "c: HTTP b1 TPOT p50 / (bytes per step / HBM)", b1["tpot_p50_ms"], floor,
           1.25, False)


def disagg_goals(s: Session, who: str) -> None:
    g = {label: r["figures"] for label, r in s.groups.items()}
    tag = "" if who == "disagg" else who[len("disagg"):]
    pairs = [("d_peak_tok_s", "c=C steady tok/s", "peak", "steady_output_tok_s", 0.95, True),
             ("d_peak_ttft_p50", "c=C TTFT p50", "peak", "ttft_p50_ms", 1.5, False),
             ("d_mixed_bg_tpot_p99", "mixed, background TPOT p99", "mixed", "background_tpot_p99_ms", 0.7, False),
             ("d_mixed_bg_itl_p99", "mixed, background ITL p99", "mixed", "background_itl_p99_ms", 0.7, False)]
    for key, name, group, figure, goal, at_least in pairs:
        num, den = g.get(f"{who} {group}", {}).get(figure), g.get(f"agg {group}", {}).get(figure)
        s.goal(key + tag.replace("-", "_"), f"d: {name}, {who} / agg", num, den, goal, at_least)
    for target in ("agg", who):
        for group in ("peak", "mixed"):
            found = g.get(f"{target} {group}", {})
            s.emit(f"goodput {target} {group}", goodput_req_s=found.get("goodput_req_s"),
                   slo_attainment=found.get("slo_attainment"), slo=s.slo.as_dict())


def aggregated(s: Session, args: argparse.Namespace) -> None:
    """b, c and the aggregated half of d on one fresh server."""
    with ExitStack() as stack:
        target = None
        with s.phase("agg start"):
            profile = args.out / "agg-py-spy.txt" if args.profile_agg else None
            target = start(s, stack, ServerUnderTest(s.config["agg"], env=s.server_env, profile=profile), "agg")
        if target is None:
            return
        phases = (("b", lambda: fresh_phase(s, args, target)), ("c", lambda: peak_phase(s, args, target)),
                  ("d-agg", lambda: s.runs(target, "agg", "mixed", [mixed_plan(args, s.seed())])))
        for name, run in phases:
            if name[0] not in args.skip:
                with s.phase(name):
                    run()


def disaggregated(s: Session, args: argparse.Namespace, variant: str) -> None:
    """d on the pair; variant `mps`: under the launcher's MPS daemon (`gpu_share`), the context server
    capped at --context-sm-pct; `split`: the same with `router.conditional: {}`."""
    who = "disagg" if variant == "plain" else f"disagg-{variant}"
    with ExitStack() as stack, s.phase(f"d-{who}"):
        env, config = dict(s.server_env), s.config["disagg"]
        if variant in ("mps", "split"):
            config = s.config[who]
        server = ServerUnderTest(config, env=env)
        target = start(s, stack, server, who)
        warm_up(target.url, target.model, s.vocab)
        peak = closed_plan(args, args.peak_concurrency, s.seed(), duration_s=args.peak_duration)
        s.runs(target, who, "peak", [peak])
        s.runs(target, who, "mixed", [mixed_plan(args, s.seed())])
        disagg_goals(s, who)
        if args.with_extras and variant == "plain":
            with s.phase("f"):
                s.emit("handoff", **handoff_share(server, target, args, s.vocab))


def handoff_share(server: ServerUnderTest, target: LoadTarget, args: argparse.Namespace,
                  vocab: list[int]) -> dict[str, float]:
    """f: fresh --handoff-len prompts (two tokens each: the generation leg pulls the KV) through the
    router; the generation server's handoff time per transfer against the context server's TTFT."""
    from bench_gpu_serving import PHASES, _pair_metrics

    pair = tuple(server_urls(server.deployment, section)[0] for section in ("context_servers", "generation_servers"))
    rng = random.Random(19)
    before = _pair_metrics(pair)
    for _ in range(args.handoff_prompts):
        body = {"model": target.model, "prompt": [rng.choice(vocab) for _ in range(args.handoff_len)],
                "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
        answer = httpx.post(f"{target.url}/v1/completions", json=body, timeout=600)
        answer.raise_for_status()
    after = _pair_metrics(pair)
    n = max(1.0, after["transfers"] - before["transfers"])
    out = {"prompt_tokens": args.handoff_len, "transfers": after["transfers"] - before["transfers"],
           "handoff_ms_mean": (after["transfer_s"] - before["transfer_s"]) / n * 1e3,
           "context_leg_ms_mean": (after["ctx_ttft_s"] - before["ctx_ttft_s"]) / n * 1e3}
    out |= {f"handoff_{p}_ms_mean": (after[p] - before[p]) / n * 1e3 for p in PHASES}
    out["handoff_vs_context_leg"] = out["handoff_ms_mean"] / out["context_leg_ms_mean"] if out["context_leg_ms_mean"] \
        else float("nan")
    return out


def launched(s: Session, args: argparse.Namespace) -> None:
    """e and burst on one deployment under `pdserve launch` (the restart policy): bursts on its first
    server, fresh; then kill the server and measure the launcher's restart (e); then kill it again
    and burst the server restarted anew."""
    with ExitStack() as stack:
        server, target = ServerUnderTest(s.config["restart"], env=s.server_env, launcher=True), None
        with s.phase("launched start"):
            target = start(s, stack, server, "launched")
        if target is None:
            return
        bursts = "burst" not in args.skip
        if bursts:
            with s.phase("burst-fresh"):
                burst_phase(s, args, target, "burst-fresh", "fresh server")
        else:
            warm_up(target.url, target.model, s.vocab)  # the server killed has served
        if "e" not in args.skip:
            with s.phase("e"):
                restarted(s, args, server, target)
        if bursts:
            with s.phase("burst-restarted"):
                _kill_and_wait(s, server, "burst_restart")
                burst_phase(s, args, target, "burst-restarted", "restarted server")


def restarted(s: Session, args: argparse.Namespace, server: ServerUnderTest, target: LoadTarget) -> None:
    """e: kill the launcher's server, let it come back, measure its first runs."""
    _kill_and_wait(s, server, "restart")
    plans = [closed_plan(args, args.warm_concurrency, s.seed(), duration_s=args.restart_duration) for _ in range(2)]
    runs = s.runs(target, "restarted", "first runs", plans)
    s.goal("e_restart_server_ttft", "e: restarted server, server TTFT mean, run 1 / run 2",
           runs[0]["server_ttft_mean_ms"], runs[1]["server_ttft_mean_ms"], 1.5, False)
    s.goal("e_restart_client_ttft", "e: restarted server, client TTFT mean, run 1 / run 2",
           runs[0]["ttft_mean_ms"], runs[1]["ttft_mean_ms"], 1.5, False)


def burst_phase(s: Session, args: argparse.Namespace, target: LoadTarget, who: str, what: str) -> None:
    """--burst-runs closed-loop runs whose --burst-concurrency streams start at once; run 1 / the last."""
    plans = [closed_plan(args, args.burst_concurrency, s.seed(), count=args.burst_requests)
             for _ in range(args.burst_runs)]
    runs = s.runs(target, who, "burst", plans)
    key, last = who.replace("-", "_"), len(runs)
    s.goal(f"{key}_server_ttft", f"burst: {what}, server TTFT mean, run 1 / run {last}",
           runs[0]["server_ttft_mean_ms"], runs[-1]["server_ttft_mean_ms"], 1.5, False)
    s.goal(f"{key}_client_ttft", f"burst: {what}, client TTFT mean, run 1 / run {last}",
           runs[0]["ttft_mean_ms"], runs[-1]["ttft_mean_ms"], 1.5, False)


def _kill_and_wait(s: Session, server: ServerUnderTest, figure: str) -> None:
    """SIGKILL the launcher's server and wait until the launcher has brought it back (`figure`: the
    restart time)."""
    old = server_pid(server.pid, "aggregated-0")
    killed = time.perf_counter()
    os.kill(old, signal.SIGKILL)
    _wait_restarted(server, old)
    s.emit(figure, restart_s=time.perf_counter() - killed)


def _wait_restarted(server: ServerUnderTest, old: int) -> None:
    """Until the launcher has started a new server process and it answers /health."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    alive = lambda: server.proc is not None and server.proc.poll() is None
    while alive() and time.monotonic() < deadline:
        try:
            if server_pid(server.pid, "aggregated-0") != old:
                break
        except LookupError:
            pass
        time.sleep(0.2)
    if not wait_for_health(server.url, max(0.0, deadline - time.monotonic()), alive):
        raise RuntimeError(f"the launcher did not bring the server back:\n{server.log_tail()}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gpu"))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")),
                   help="records.jsonl, report.md, plots/ (default $OUT)")
    p.add_argument("--model", help="serve this model instead of building the 8B-shaped one (CPU smoke runs)")
    p.add_argument("--skip", default="", help="phases to leave out, e.g. e or c,e,burst (a: only build the model)")
    p.add_argument("--with-extras", action="store_true", help="phase f: KV handoff share and prefill TFLOP/s")
    p.add_argument("--disagg-variants", default="plain", help="d: plain, mps (the pair under CUDA MPS, "
                   "the context server's SM share --context-sm-pct; short prompts served by the generation server, "
                   "the launcher's default on one GPU) and/or split (mps with every prompt through the context "
                   "server), comma-separated")
    p.add_argument("--context-sm-pct", type=int, default=100,
                   help="d with mps: the context server's gpu_share (a cap below 100 is refused)")
    p.add_argument("--profile-agg", action="store_true", help="py-spy the aggregated server (agg-py-spy.txt)")
    p.add_argument("--client-procs", type=int, default=default_procs())
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the servers and the engine phase (repeatable)")
    sizes = {  # flag: (default, help)
        "layers": (32, "of the 8B-shaped model"), "max-seq-len": (8192, ""), "max-num-tokens": (8192, ""),
        "max-batch-size": (64, ""), "input-len": (128, "every closed-loop request"), "output-len": (256, ""),
        "warm-concurrency": (32, "b and e"), "warm-runs": (3, "b"), "peak-concurrency": (64, "c, d and a"),
        "b1-requests": (3, "c"), "mixed-concurrency": (32, "d: background streams"),
        "long-input-len": (2048, "d"), "long-output-len": (256, "d"), "handoff-len": (4096, "f"),
        "handoff-prompts": (3, "f"), "burst-concurrency": (32, "burst: streams, all started at once"),
        "burst-requests": (128, "burst: each run"), "burst-runs": (3, "burst: runs on each server")}
    for name, (default, text) in sizes.items():
        p.add_argument(f"--{name}", type=int, default=default, help=f"{text} (default {default})")
    seconds = {"warm-duration": (8.0, "b: each run"), "peak-duration": (10.0, "c and d"),
               "mixed-duration": (15.0, "d"), "restart-duration": (10.0, "e: each of the two runs"),
               "ramp-s": (2.0, "staggered start of every run"), "long-rate": (1.0, "d: long prompts per second"),
               "window-s": (60.0, "first window of a run"), "slo-ttft-ms": (1000.0, "goodput SLO"),
               "slo-tpot-ms": (20.0, "goodput SLO"), "engine-timeout-s": (400.0, "phase a")}
    for name, (default, text) in seconds.items():
        p.add_argument(f"--{name}", type=float, default=default, help=f"{text} (default {default:g})")
    args = p.parse_args(argv)
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def main() -> int:
    args = parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(item.split("=", 1) for item in args.server_env)
    s = Session(args, RecordWriter(args.out, RunContext.capture(["scripts/bench_gpu_load.py", *sys.argv[1:]])), env)
    with s.phase("a"):
        model = engine_phase(s, args)
        s.vocab = model_vocab(model)
        kinds = ("agg", "disagg", "disagg-mps", "disagg-split", "restart")
        s.config = {kind: deployment_file(args, model, kind) for kind in kinds}
    if s.vocab:
        if not {"b", "c", "d"} <= args.skip:
            aggregated(s, args)
        for variant in args.disagg_variants.split(",") if "d" not in args.skip else ():
            disaggregated(s, args, variant)
        if not {"e", "burst"} <= args.skip:
            launched(s, args)
    s.finish(args.out)
    return 0 if s.vocab else 1


if __name__ == "__main__":
    sys.exit(main())
