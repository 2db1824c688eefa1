"""A third-party backend, installed the way users install one, found by name from YAML.

The example plugin package (examples/tiercache-example-plugin) registers
``example_memory`` under the entry point group ``tiercache.backends``. These
tests install it into the running interpreter's environment (``pip install
--no-deps --no-build-isolation -e``, once; skipped with pip's reason if that
fails), then:

* resolve it by name through :func:`tiercache.tiers.registry.backend_class`, in a
  fresh interpreter and in this one, and build it from a YAML tier;
* run the conformance kit against the class the registry returns;
* run the plugin's own kit module in a fresh pytest, as its author would;
* run the kit against deliberately broken backends and check that it fails
  each of them where it should (the kit has teeth).
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import subprocess
import sys
import sysconfig
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest

from tiercache.backend import Backend, BackendContext
from tiercache.config.schema import ConfigError, load_config
from tiercache.integrity import compact_header_len
from tiercache.tiers.registry import available_backends, backend_class, create_backend
from tiercache.testing.conformance import BackendConformance, make_key

REPO = pathlib.Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "examples" / "tiercache-example-plugin"
PLUGIN_NAME = "example_memory"
PLUGIN_MODULE = "tiercache_example_plugin"
_RESOLVE = (
    "from tiercache.tiers.registry import backend_class; import inspect; "
    f"print(inspect.getfile(backend_class({PLUGIN_NAME!r})))"
)


def _resolved_file_in_fresh_interpreter() -> pathlib.Path | None:
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        check=False,
    )
    return pathlib.Path(proc.stdout.strip()) if proc.returncode == 0 else None


def _is_ours(path: pathlib.Path | None) -> bool:
    return path is not None and PLUGIN_DIR in path.resolve().parents


def _install() -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "-e",
        str(PLUGIN_DIR),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot install the example plugin ({' '.join(cmd)}): {proc.stderr[-1500:]}")


def _importable_here() -> None:
    """Make a just-installed editable package importable without restarting this interpreter."""
    importlib.invalidate_caches()
    if importlib.util.find_spec(PLUGIN_MODULE) is not None:
        return
    site_packages = pathlib.Path(sysconfig.get_paths()["purelib"])
    for pth in site_packages.glob(f"*{PLUGIN_MODULE}*.pth"):  # what site.py does at start-up
        for line in pth.read_text().splitlines():
            if line.startswith(("import ", "import\t")):
                exec(line)  # noqa: S102 - the .pth line pip just wrote
            elif line.strip() and pathlib.Path(line.strip()).is_dir():
                sys.path.append(line.strip())
    importlib.invalidate_caches()


def _forget_other_copies() -> None:
    """Drop a copy of the plugin this interpreter found at start-up in another checkout."""
    for name in [m for m in sys.modules if m == PLUGIN_MODULE or m.startswith(PLUGIN_MODULE + ".")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if "tiercache-example-plugin" not in p or _is_ours(pathlib.Path(p) / "x")]
    # setuptools' editable installs map the package with a finder on sys.meta_path.
    sys.meta_path[:] = [f for f in sys.meta_path if PLUGIN_MODULE not in getattr(f, "__module__", "")]
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def plugin_class() -> type[Backend]:
    """The example plugin's class as the registry resolves it, installing it first if needed."""
    if not _is_ours(_resolved_file_in_fresh_interpreter()):
        _install()  # absent, or an install from another checkout of this repo
        found = _resolved_file_in_fresh_interpreter()
        assert _is_ours(found), f"installed, but {PLUGIN_NAME!r} resolves to {found}"
        _forget_other_copies()
    _importable_here()
    cls = backend_class(PLUGIN_NAME)
    assert _is_ours(pathlib.Path(sys.modules[cls.__module__].__file__ or ""))
    return cls


# ---------------------------------------------------------------------------- registry
def test_found_by_name_from_yaml(plugin_class: type[Backend], tmp_path: pathlib.Path) -> None:
    assert available_backends()[PLUGIN_NAME] == f"{PLUGIN_MODULE}.backend:ExampleMemoryBackend"
    config_file = tmp_path / "tiercache.yaml"
    config_file.write_text(
        textwrap.dedent(
            f"""
        tiers:
          - {{name: cpu, backend: cpu, capacity: 1MiB}}
          - name: dict
            backend: {PLUGIN_NAME}
            capacity: 1MiB
            options: {{max_chunks: 3}}
        """
        )
    )
    tier = load_config(config_file).tiers[1]
    context = BackendContext("dict", b"yaml-ns1", 1024, tier.capacity)
    backend = create_backend(tier, context, index=1)
    assert type(backend) is plugin_class and backend.name == PLUGIN_NAME
    assert backend.settings.max_chunks == 3  # type: ignore[attr-defined]
    bad = tier.model_copy(update={"options": {"max_chunk": 3}})
    with pytest.raises(ConfigError, match="tiers.1.options.max_chunk: unknown key"):
        create_backend(bad, context, index=1)


# ---------------------------------------------------------------------------- the kit
class TestExamplePluginConformance(BackendConformance):
    """The kit against the class resolved through the entry point."""

    persistent = False
    bytes_per_chunk = compact_header_len(len(make_key(0))) + BackendConformance.chunk_bytes

    @pytest.fixture(autouse=True)
    def _plugin(self, plugin_class: type[Backend]) -> Iterator[None]:
        self.cls = plugin_class
        yield

    def make_backend(self, path: pathlib.Path, context: BackendContext) -> Backend:
        return self.cls(self.cls.settings_model(), context)  # type: ignore[call-arg]

    def corrupt_chunk(self, backend: Backend, key: bytes) -> None:
        frames = backend.frames  # type: ignore[attr-defined]
        frames[key] = frames[key][:-1] + bytes([frames[key][-1] ^ 0x01])

    def used_bytes(self, backend: Backend, path: pathlib.Path) -> int:
        return sum(len(f) for f in backend.frames.values())  # type: ignore[attr-defined]


def test_plugin_own_suite_in_a_fresh_pytest(
    plugin_class: type[Backend], tmp_path: pathlib.Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'base'}",  # not the shared numbered dirs (and their cleanup)
            str(PLUGIN_DIR / "tests"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PLUGIN_DIR,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


# ---------------------------------------------------------------------------- kit teeth
BROKEN = textwrap.dedent(
    '''
    """Backends that each break one rule of the contract, run through the kit."""
    import time
    from tiercache.backend import Backend, BackendSettings, JobResult
    from tiercache.testing.conformance import BackendConformance


    class DictBackend(Backend):
        name = "dict"
        settings_model = BackendSettings

        def __init__(self, context):
            self.context, self.data, self.done = context, {}, []

        def fits(self, key):
            per = self.context.chunk_bytes
            return key in self.data or (len(self.data) + 1) * per <= self.context.capacity_bytes

        def store(self, key, view):
            self.data[key] = bytes(view)

        def submit_put(self, job_id, keys, views):
            ok = [k for k, v in zip(keys, views) if self.fits(k) and self.store(k, v) is None]
            self.report(job_id, keys, ok)

        def submit_get(self, job_id, keys, views):
            ok = []
            for key, view in zip(keys, views):
                if key in self.data:
                    view[:] = self.data[key]
                    ok.append(key)
            self.report(job_id, keys, ok)

        def report(self, job_id, keys, ok):
            failed = tuple(k for k in keys if k not in ok)
            per = self.context.chunk_bytes
            self.done.append(JobResult(job_id, tuple(ok), failed, len(ok) * per, 0.0))

        def poll(self):
            done, self.done = self.done, []
            return done

        def delete(self, keys):
            for key in keys:
                self.data.pop(key, None)

        def close(self):
            pass


    class NoBudget(DictBackend):
        def fits(self, key):
            return True


    class KeepsViews(DictBackend):
        def store(self, key, view):
            self.data[key] = view  # the caller's buffer, not a copy


    class ReportsTwice(DictBackend):
        def poll(self):
            done = super().poll()
            return done + done


    class Reorders(DictBackend):
        def report(self, job_id, keys, ok):
            super().report(job_id, keys, list(reversed(ok)))


    class Kit(BackendConformance):
        backend = DictBackend

        def make_backend(self, path, context):
            return self.backend(context)


    class TestSound(Kit):
        backend = DictBackend


    class TestNoBudget(Kit):
        backend = NoBudget


    class TestKeepsViews(Kit):
        backend = KeepsViews


    class TestReportsTwice(Kit):
        backend = ReportsTwice


    class TestReorders(Kit):
        backend = Reorders
    '''
)


def test_the_kit_fails_broken_backends(tmp_path: pathlib.Path) -> None:
    (tmp_path / "test_broken.py").write_text(BROKEN)
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'base'}",
            f"--junitxml={report}",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_broken.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-2000:]
    failed: dict[str, set[str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.setdefault(case.get("classname", "").rsplit(".", 1)[-1], set()).add(
                case.get("name", "")
            )
    assert "TestSound" not in failed, f"the kit fails a sound backend: {failed.get('TestSound')}"
    expected = {
        "TestNoBudget": {
            "test_budget_refuses_then_delete_frees",
            "test_failed_put_leaves_no_chunk",
        },
        "TestKeepsViews": {"test_put_view_not_kept"},
        "TestReportsTwice": {"test_round_trip", "test_batch_semantics", "test_concurrent_jobs"},
        "TestReorders": {"test_batch_semantics", "test_concurrent_jobs"},
    }
    for cls, tests in expected.items():
        assert tests <= failed.get(cls, set()), (
            f"{cls}: kit missed {tests - failed.get(cls, set())}"
        )
