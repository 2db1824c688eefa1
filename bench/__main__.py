"""One way to run every benchmark: ``python -m bench <name> [options]``.

Without a name (or with ``-h``/``--help``) it lists the benchmarks, each with
the first line of its docstring; with one it runs ``bench/<name>.py``'s
``main(argv)`` with the options that follow (``python -m bench <name> --help``
for that benchmark's own help). A benchmark is any module of bench/ with a
top-level ``main``; the list is read from the sources (``ast``), so listing
imports no benchmark (some import torch or vLLM, which takes seconds).
``python bench/<name>.py [options]`` runs the same ``main``.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """``{name: one-line summary}`` of every module in bench/ that has a ``main``."""
    found: dict[str, str] = {}
    for path in sorted(BENCH_DIR.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            doc = ast.get_docstring(tree) or ""
            found[path.stem] = doc.split("\n", 1)[0].strip()
    return found


def usage(found: dict[str, str]) -> str:
    width = max(map(len, found), default=0)
    lines = [
        "usage: python -m bench <name> [options]    (or: python bench/<name>.py [options])",
        "",
        "Benchmarks; each prints its figures next to a ceiling measured in the same run,",
        "most also write bench/results/<name>.json. `python -m bench <name> --help` says",
        "what one measures, its ceiling, its options and examples; most take --quick (a",
        "short smoke run). e2e, pd and serve start vLLM engines; pd, pd_memory and pd_replay need",
        "NIXL; cuda_batched_copy needs CUDA.",
        "",
    ]
    lines += [f"  {name.ljust(width)}  {summary}" for name, summary in found.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    found = benchmarks()
    if not args or args[0] in ("-h", "--help"):
        print(usage(found))
        return 0
    name, rest = args[0].removesuffix(".py"), args[1:]
    if name not in found:
        print(usage(found), file=sys.stderr)
        print(f"\nunknown benchmark {args[0]!r}", file=sys.stderr)
        return 2
    rc = importlib.import_module(f"bench.{name}").main(rest)
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
