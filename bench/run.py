"""CLI: `python -m bench [--quick] [--scenarios 1,2,3,4,5] [--engine vllm|transformers] [--dtype ...]`.

Starts a private Redis on a free port, builds the benchmark checkpoints under bench/checkpoints
(once), runs the chosen scenarios one after another (never two systems under test at once: on a
small machine they would measure each other), and writes the report. A scenario that fails is
reported as failed; the others still run. Service logs go to a temp dir named in the report.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import tempfile
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

from bench import s1_fanout, s2_overhead, s3_transport, s4_batching, s5_epd
from bench.machine import command_line, machine_info
from bench.our_stack import StackOptions
from bench.outcome import ScenarioResult
from bench.procs import REPO
from bench.report import write_report
from bench.s1_fanout import FanoutOptions
from bench.s2_overhead import OverheadOptions
from model_builders.bench import build_bench_all
from model_builders.tiny import build_all
from scripts.ports import free_port
from scripts.stack import ensure_redis

TITLES = {
    "1": "Fan-out VQA",
    "2": "Overhead of our path",
    "3": "Transport",
    "4": "Encoder batching",
    "5": "Ours vs vLLM's encoder disaggregation (EPD)",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="scenarios 2 and 3 at small sizes (regression check, about 4 min on 2 cores)",
    )
    parser.add_argument(
        "--scenarios", default=None, help="comma-separated subset of 1,2,3,4,5 (default: all; --quick: 2,3)"
    )
    parser.add_argument(
        "--engine", choices=["vllm", "transformers"], default="vllm", help="LLM_ENGINE of our LLM services"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="dtype of every model process, ours and the baselines alike")  # fmt: skip
    parser.add_argument("--checkpoints", type=Path, default=REPO / "bench" / "checkpoints")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results (--quick: bench/results/quick)")
    args = parser.parse_args()
    # Quick regression runs must not replace the full run's latest.md.
    args.out = args.out or REPO / "bench" / "results" / ("quick" if args.quick else "")
    chosen = args.scenarios or ("2,3" if args.quick else ",".join(TITLES))
    args.scenarios = [s.strip() for s in chosen.split(",") if s.strip()]
    unknown = set(args.scenarios) - set(TITLES)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    return args


def _run_one(key: str, args: argparse.Namespace, redis_url: str, log_dir: Path, nonce: int) -> ScenarioResult:
    stack = StackOptions(redis_url, args.engine, args.dtype, eager=args.quick)
    if key == "3":
        return s3_transport.run(redis_url, args.quick)
    if key == "2":
        if args.quick:  # tiny checkpoints: start in seconds, same code path
            checkpoint = build_all(args.checkpoints / "tiny")["ft-a"]
        else:
            checkpoint = build_bench_all(args.checkpoints)["ft-1"]
        return s2_overhead.run(stack, OverheadOptions(checkpoint, args.quick), log_dir, nonce)
    built = build_bench_all(args.checkpoints)
    if key == "4":
        return s4_batching.run(
            redis_url, built["base"], args.dtype, log_dir, nonce, sequential_images=4 if args.quick else 8
        )
    finetunes = {name: path for name, path in built.items() if name != "base"}
    if key == "5":
        return s5_epd.run(stack, FanoutOptions(built["base"], finetunes), log_dir, nonce)
    return s1_fanout.run(stack, FanoutOptions(built["base"], finetunes), log_dir, nonce)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    args = parse_args()
    started = datetime.datetime.now().replace(microsecond=0)
    options = {"quick": args.quick, "scenarios": args.scenarios, "engine": args.engine, "dtype": args.dtype}
    header = {"command": command_line(), "started": started.isoformat(), "machine": machine_info(), "options": options}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    header["logs"] = str(log_dir)
    nonce = int(time.time())
    results = []
    with ExitStack() as stack:
        redis_url = f"redis://127.0.0.1:{free_port()}/0"
        ensure_redis(redis_url, stack)
        for key in args.scenarios:
            logging.info("scenario %s: %s", key, TITLES[key])
            began = time.monotonic()
            try:
                result = _run_one(key, args, redis_url, log_dir, nonce)
            except Exception as error:  # one broken scenario must not lose the others' results
                logging.exception("scenario %s failed", key)
                failure = [f"FAILED: {error!r}"[:2000], "traceback: " + traceback.format_exc()[-1500:]]
                result = ScenarioResult(key, f"{TITLES[key]} (FAILED)", [], {}, notes=failure)
            result.config["duration_s"] = round(time.monotonic() - began, 1)
            results.append(result)
    header["duration_s"] = (datetime.datetime.now() - started).total_seconds()
    # With the start's, tells whether other work shared the machine during the run.
    header["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    paths = write_report(results, header, args.out)
    logging.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    print(paths["md"].read_text())
