"""Speculative decoding against none, in one process: single-stream decode and batch throughput on
input-copying work (copy1, copy16: the work prompt lookup speeds up) and on plain text (w32: the work it
must not slow down). A benchmark, not a test.

    .venv/bin/python scripts/bench_spec_decode.py [--threads 2] [--draft] [--out spec.json]
    .venv/bin/python scripts/bench_spec_decode.py --configs off --limit 2 --repeats 1   # a quick look

Configurations (--configs, comma-separated): off (no speculation), ngram (prompt lookup, --k draft tokens,
suffixes of --lookup-min..--lookup-max tokens), draft (a draft model, --draft-model, --draft-quantization;
--draft adds it), and any NAME=JSON given with --config (a --speculative-config value). Every engine is
built one after the other and warmed up; by default all stay alive and the repeats are interleaved (round
r runs every workload on every configuration, the configurations' order rotating each round), which the
default model (~100 MB, 1 GiB KV cache an engine) allows. --sequential runs one configuration's repeats at
a time and frees its engine (gc) before building the next, to bound memory.

Each run is pagedllm.bench.throughput.run_offline: greedy, ignore_eos, prefix cache reset first. Reported:
the median over the repeats of copy1's decode tok/s (the per-request decode speed after the first token)
and of copy16's and w32's output tok/s, each configuration's ratio to off, and from
get_stats().spec_decode (differences around each run, summed over the repeats) the acceptance rate
(accepted / draft tokens), the mean acceptance length (1 + accepted / drafts, the tokens a verify step
yields) and the acceptance rate at each draft position (drafts whose token at that position was accepted /
drafts). --check also generates each workload once per configuration and counts the requests whose tokens
equal off's (greedy speculation must not change the output; a few may differ where the verify step's
batched arithmetic rounds differently).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT.parent / "shared" / "bench"
WORKLOADS = {  # name: (file, the figure reported for it)
    "copy1": ("copy1.jsonl", "decode_tok_s"),
    "copy16": ("copy16.jsonl", "output_tok_s"),
    "w32": ("w32.jsonl", "output_tok_s"),
}
SPEC_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--configs", default="off,ngram", help="comma-separated: off, ngram, draft")
    ap.add_argument("--draft", action="store_true", help="add the draft configuration")
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="one more configuration: a --speculative-config value (repeatable)",
    )
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of ngram and draft")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--draft-model", default="default")
    ap.add_argument("--draft-quantization", default="gguf")
    ap.add_argument(
        "--workloads", default="copy1,copy16,w32", help=f"comma-separated, of {', '.join(WORKLOADS)}"
    )
    ap.add_argument("--bench-dir", type=Path, default=BENCH_DIR)
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts of each workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sequential", action="store_true", help="one engine alive at a time, no interleaving")
    ap.add_argument("--check", action="store_true", help="compare each configuration's tokens with off's")
    ap.add_argument("--quantization", default=None, help="the target's --quantization (engine default)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (as the CLI's --threads)")
    ap.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def spec_configs(args: argparse.Namespace) -> dict[str, dict | None]:
    """name -> speculative_config (None: off), in the order given."""
    known = {
        "off": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        },
        "draft": {
            "method": "draft_model",
            "model": args.draft_model,
            "quantization": args.draft_quantization,
            "num_speculative_tokens": args.k,
        },
    }
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if args.draft and "draft" not in names:
        names.append("draft")
    out: dict[str, dict | None] = {}
    for name in names:
        if name not in known:
            sys.exit(f"unknown configuration {name!r} (known: {', '.join(known)}; or use --config NAME=JSON)")
        out[name] = known[name]
    for item in args.config:
        name, sep, text = item.partition("=")
        if not sep or not name:
            sys.exit(f"--config takes NAME=JSON, got {item!r}")
        out[name] = json.loads(text)
    if not out:
        sys.exit("no configuration to run")
    return out


def build_llm(args: argparse.Namespace, spec: dict | None):
    from pagedllm import LLM

    kwargs: dict = {"show_progress": False}
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.dtype is not None:
        kwargs["dtype"] = args.dtype
    if spec is not None:  # spec-off engines are built as before speculative decoding existed
        kwargs["speculative_config"] = spec
    try:
        return LLM(args.model, **kwargs)
    except TypeError as e:
        if spec is not None and "speculative_config" in str(e):
            sys.exit(f"this engine takes no speculative_config yet ({e}); run --configs off")
        raise


def spec_snapshot(llm) -> dict | None:
    """The engine's cumulative speculation counters now (None: speculation off, or an engine without it)."""
    s = getattr(llm.llm_engine.get_stats(), "spec_decode", None)
    if s is None:
        return None
    snap = {f: int(getattr(s, f, 0)) for f in SPEC_FIELDS}
    snap["num_accepted_tokens_per_pos"] = [int(x) for x in getattr(s, "num_accepted_tokens_per_pos", [])]
    return snap


def spec_diff(after: dict | None, before: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {f: 0 for f in SPEC_FIELDS} | {"num_accepted_tokens_per_pos": []}
    d = {f: after[f] - before[f] for f in SPEC_FIELDS}
    b = before["num_accepted_tokens_per_pos"]
    d["num_accepted_tokens_per_pos"] = [
        x - (b[i] if i < len(b) else 0) for i, x in enumerate(after["num_accepted_tokens_per_pos"])
    ]
    return d


def spec_add(total: dict | None, d: dict | None) -> dict | None:
    if d is None:
        return total
    if total is None:
        return {f: d[f] for f in SPEC_FIELDS} | {
            "num_accepted_tokens_per_pos": list(d["num_accepted_tokens_per_pos"])
        }
    for f in SPEC_FIELDS:
        total[f] += d[f]
    a, b = total["num_accepted_tokens_per_pos"], d["num_accepted_tokens_per_pos"]
    total["num_accepted_tokens_per_pos"] = [
        (a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(max(len(a), len(b)))
    ]
    return total


def spec_summary(c: dict | None) -> dict | None:
    """The counters with vLLM's derived figures (SpecDecodingStats' properties, computed from the counts)."""
    if c is None:
        return None
    drafts, draft_tokens, accepted = c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]
    return {
        **c,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
        "acceptance_rate_per_pos": [x / drafts if drafts else 0.0 for x in c["num_accepted_tokens_per_pos"]],
    }


def run_once(llm, prompts) -> tuple[dict, dict | None]:
    from pagedllm.bench.throughput import run_offline

    before = spec_snapshot(llm)
    r = run_offline(llm, prompts, use_tqdm=False)
    d = spec_diff(spec_snapshot(llm), before)
    return {
        "elapsed_s": r["elapsed_time"],
        "output_tokens": r["output_tokens"],
        "prompt_tokens": r["prompt_tokens"],
        "output_tok_s": r["output_tokens"] / r["elapsed_time"],
        "decode_tok_s": r["decode_tokens_per_second"],
        "median_ttft_s": r["median_ttft_s"],
    }, d


def warm_up(llm, prompts) -> None:
    """One short request of the first workload (its prompt, 16 tokens), so a configuration's first measured
    run pays no one-time cost (allocations, the verify step's first shapes)."""
    from pagedllm.sampling_params import SamplingParams

    llm.generate(
        [prompts[0].prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )


def output_tokens(llm, prompts) -> list[list[int]]:
    from pagedllm.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True) for p in prompts]
    llm.reset_prefix_cache()
    return [
        list(o.outputs[0].token_ids)
        for o in llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    ]


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from pagedllm.bench.dataset import load_dataset
    from pagedllm.entrypoints.engine_args import apply_threads

    apply_threads(args)  # before the first model loads
    configs = spec_configs(args)
    names = list(configs)
    wl_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in wl_names:
        if w not in WORKLOADS:
            sys.exit(f"unknown workload {w!r} (known: {', '.join(WORKLOADS)})")
    workloads = {w: load_dataset(args.bench_dir / WORKLOADS[w][0], num_prompts=args.limit) for w in wl_names}

    runs: dict[str, dict[str, list[dict]]] = {n: {w: [] for w in wl_names} for n in names}
    spec: dict[str, dict[str, dict | None]] = {n: {w: None for w in wl_names} for n in names}
    tokens: dict[str, dict[str, list[list[int]]]] = {n: {} for n in names}
    load_s: dict[str, float] = {}

    def build(name: str):
        t = time.perf_counter()
        llm = build_llm(args, configs[name])
        warm_up(llm, next(iter(workloads.values())))
        load_s[name] = time.perf_counter() - t
        print(f"[{name}] engine built and warmed up in {load_s[name]:.1f} s", flush=True)
        return llm

    def measure(name: str, llm, w: str, r: int) -> None:
        res, d = run_once(llm, workloads[w])
        runs[name][w].append(res)
        spec[name][w] = spec_add(spec[name][w], d)
        acc = f", acceptance {spec_summary(d)['acceptance_rate']:.2f}" if d is not None else ""
        print(
            f"  round {r + 1} {name:>8} {w:>7}: {res['output_tok_s']:7.1f} output tok/s, "
            f"{res['decode_tok_s']:6.1f} decode tok/s{acc}",
            flush=True,
        )

    def check(name: str, llm) -> None:
        if args.check:
            for w in wl_names:
                tokens[name][w] = output_tokens(llm, workloads[w])

    if args.sequential:
        for name in names:
            llm = build(name)
            for r in range(args.repeats):
                for w in wl_names:
                    measure(name, llm, w, r)
            check(name, llm)
            del llm
            gc.collect()
    else:
        engines = {name: build(name) for name in names}
        for r in range(args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first each round
            for w in wl_names:
                for name in order:
                    measure(name, engines[name], w, r)
        for name in names:
            check(name, engines[name])
        del engines
        gc.collect()

    results: dict = {
        "configs": {},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    base = "off" if "off" in names else None
    for name in names:
        entry: dict = {"speculative_config": configs[name], "load_s": load_s[name], "workloads": {}}
        for w in wl_names:
            key = WORKLOADS[w][1]
            m = {
                k: median([x[k] for x in runs[name][w]])
                for k in ("output_tok_s", "decode_tok_s", "median_ttft_s")
            }
            ratio = None
            if base is not None and name != base:
                b = median([x[key] for x in runs[base][w]])
                ratio = m[key] / b if b else None
            e = {
                "metric": key,
                "median": m[key],
                "ratio_to_off": ratio,
                "median_output_tok_s": m["output_tok_s"],
                "median_decode_tok_s": m["decode_tok_s"],
                "median_ttft_s": m["median_ttft_s"],
                "runs": runs[name][w],
                "spec_decode": spec_summary(spec[name][w]),
            }
            if args.check and base is not None and name != base:
                a, b = tokens[name][w], tokens[base][w]
                e["same_tokens_as_off"] = sum(x == y for x, y in zip(a, b))
                e["requests"] = len(a)
            entry["workloads"][w] = e
        results["configs"][name] = entry
    results["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_tables(results, names, wl_names, args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nwrote {args.out}")


def print_tables(results: dict, names: list[str], wl_names: list[str], args: argparse.Namespace) -> None:
    out_tokens = {
        w: results["configs"][names[0]]["workloads"][w]["runs"][0]["output_tokens"] for w in wl_names
    }
    print(
        f"\nmedians of {args.repeats} run(s); tokens generated a run: "
        + ", ".join(f"{w} {n}" for w, n in out_tokens.items())
    )
    head = [f"{w} {'decode' if WORKLOADS[w][1] == 'decode_tok_s' else 'output'} tok/s" for w in wl_names]
    print("\n| config | " + " | ".join(head) + " |")
    print("|---" * (len(head) + 1) + "|")
    for name in names:
        cells = []
        for w in wl_names:
            e = results["configs"][name]["workloads"][w]
            cell = f"{e['median']:.1f}"
            if e["ratio_to_off"] is not None:
                cell += f" ({e['ratio_to_off']:.2f}x)"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    rows = [(n, w) for n in names for w in wl_names if results["configs"][n]["workloads"][w]["spec_decode"]]
    if rows:
        print(
            "\n| config | workload | drafts | draft tokens | accepted | acceptance rate | mean acceptance length | acceptance per position |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for n, w in rows:
            e = results["configs"][n]["workloads"][w]
            s = e["spec_decode"]
            per = " ".join(f"{x:.2f}" for x in s["acceptance_rate_per_pos"])
            same = f" ({e['same_tokens_as_off']}/{e['requests']} as off)" if "same_tokens_as_off" in e else ""
            print(
                f"| {n} | {w}{same} | {s['num_drafts']} | {s['num_draft_tokens']} | {s['num_accepted_tokens']} | "
                f"{s['acceptance_rate']:.3f} | {s['mean_acceptance_length']:.2f} | {per} |"
            )
    print(f"\npeak RSS {results['max_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
