"""A spare's warm-up leaves nothing the script would see differently from a cold process.

Run in a fresh interpreter each: the warm-up builds (and destroys) a default process group, which this test
process must not carry.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_no_function_imported_during_the_warm_up_keeps_the_fake_group_as_a_default():
    out = run_python("""
        import sys, types
        from swiftrun.runtime.bootstrap import _warm_torch
        _warm_torch()
        assert "torch.distributed.nn.functional" in sys.modules, "the warm-up no longer imports it: test moot"
        import torch.distributed as dist
        import torch.distributed.nn.functional as F
        held = [f"{m.__name__}.{name}" for m in list(sys.modules.values()) for name, v in list(vars(m).items())
                if type(v) is types.FunctionType
                and any(type(d) is dist.ProcessGroup for d in (v.__defaults__ or ()))]
        print(F.all_reduce.__defaults__[-1], F.all_gather.__defaults__[-1], len(held))
    """)
    assert out == "None None 0"  # what a cold process that imports them before init_process_group holds


def test_forget_group_unbinds_globals_defaults_and_methods_by_identity():
    out = run_python("""
        import sys, types
        from swiftrun.runtime.bootstrap import forget_group

        def check():  # locals only: a global of __main__ holding the group would be unbound too
            group, other = object(), object()
            m = types.ModuleType("captures")
            sys.modules["captures"] = m
            m.__dict__.update(G=group, O=other)
            exec("def f(x, group=G, keep=O): return group\\n"
                 "def g(*, group=G): return group\\n"
                 "class C:\\n    def method(self, group=G): return group\\n"
                 "    @staticmethod\\n    def static(group=G): return group\\n"
                 "WORLD = G\\n", m.__dict__)
            del m.__dict__["G"]
            n = forget_group(group)
            print(n, m.f(0), m.g(), m.C().method(), m.C.static(), m.WORLD, m.f.__defaults__[1] is other)

        check()
    """)
    assert out == "5 None None None None None True"
