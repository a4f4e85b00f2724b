"""Reading whether a script creates swiftrun.Run (swiftrun.launcher.script)."""

from __future__ import annotations

import pytest

from swiftrun.config import Entrypoint, EntrypointKind
from swiftrun.launcher.script import uses_swiftrun
from tests.helpers import EXAMPLES, SCRIPTS


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import swiftrun\nrun = swiftrun.Run(model=m)\n", True),
        ("import torch\nfrom swiftrun import Run\n", True),
        ("def main():\n    import swiftrun as sr\n", True),
        ("from swiftrun.runtime.api import Run\n", True),
        ("import torch  # works under swiftrun too\n", False),
        ("import swiftrun_helpers\n", False),
        ("text = 'import swiftrun'\n", False),
    ],
)
def test_a_script_uses_swiftrun_when_it_imports_it(tmp_path, source, expected) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    assert uses_swiftrun(Entrypoint(EntrypointKind.SCRIPT, str(script))) is expected


def test_the_examples_and_test_scripts_are_read_as_they_are() -> None:
    assert uses_swiftrun(Entrypoint(EntrypointKind.SCRIPT, str(EXAMPLES / "train_dp.py")))
    assert not uses_swiftrun(Entrypoint(EntrypointKind.SCRIPT, str(EXAMPLES / "ddp_plain.py")))
    assert not uses_swiftrun(Entrypoint(EntrypointKind.SCRIPT, str(SCRIPTS / "import_error.py")))


def test_a_module_is_found_from_the_working_directory(tmp_path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("import swiftrun\n")
    (tmp_path / "pkg" / "plain").mkdir()
    (tmp_path / "pkg" / "plain" / "__main__.py").write_text("import torch\n")

    assert uses_swiftrun(Entrypoint(EntrypointKind.MODULE, "pkg.train"), cwd=tmp_path)
    assert not uses_swiftrun(Entrypoint(EntrypointKind.MODULE, "pkg.plain"), cwd=tmp_path)
    assert not uses_swiftrun(Entrypoint(EntrypointKind.MODULE, "pkg.missing"), cwd=tmp_path)


def test_an_executable_or_a_missing_file_is_not_read_as_using_swiftrun(tmp_path) -> None:
    assert not uses_swiftrun(Entrypoint(EntrypointKind.EXECUTABLE, "/bin/true"))
    assert not uses_swiftrun(Entrypoint(EntrypointKind.SCRIPT, str(tmp_path / "gone.py")))
