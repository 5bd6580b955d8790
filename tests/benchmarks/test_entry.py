"""python -m benchmarks NAME: each workload name runs its module's main() with the
options that make it the workload, then the caller's."""

from __future__ import annotations

from bench_scripts import load


def test_a_workload_name_runs_its_module_with_its_options_first(monkeypatch):
    entry = load("__main__")
    throughput = load("throughput")
    seen = []
    monkeypatch.setattr(throughput, "main", lambda argv: seen.append(argv) or 0)
    assert entry.main(["w1-sampled", "--small", "--out", "d"]) == 0
    assert entry.main(["w1", "--skip-peer"]) == 0
    assert seen == [["--sampling", "all", "--small", "--out", "d"], ["--skip-peer"]]


def test_every_name_names_a_module_with_a_main_and_an_unknown_name_fails():
    entry = load("__main__")
    for module, _options, _what in entry.WORKLOADS.values():
        assert callable(load(module).main), module
    assert entry.main(["w9"]) == 2 and entry.main([]) == 0


def test_the_modules_import_each_other_through_the_package_and_leave_sys_path_alone():
    import ast
    from pathlib import Path

    folder = Path(load("__main__").__file__).parent
    files = sorted(folder.glob("*.py"))
    siblings = {f.stem for f in files}
    for f in files:
        text = f.read_text()
        assert "sys.path" not in text, f.name
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            assert not set(names) & siblings, (f.name, names)
