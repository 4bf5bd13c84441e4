"""The kernel changes kept in docs/pending/ (built here, waiting for a device run) still apply to the
committed kernels: a patch that no longer applies is stale and must be redone or deleted."""
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "docs" / "pending").glob("*.patch"))
# whole-tree changes kept as patches (docs/kernels.md describes each): they must still apply as well
UNLANDED = sorted((ROOT / "docs" / "unlanded").glob("*.patch"))


def test_every_pending_patch_is_described():
    readme = (ROOT / "docs" / "pending" / "README.md").read_text()
    for patch in PATCHES:
        assert f"`{patch.name}`" in readme, f"{patch.name} is not in docs/pending/README.md"


def test_every_unlanded_patch_is_described():
    kernels_md = (ROOT / "docs" / "kernels.md").read_text()
    for patch in UNLANDED:
        assert patch.name in kernels_md, f"{patch.name} is not described in docs/kernels.md"


@pytest.mark.parametrize("patch", PATCHES + UNLANDED, ids=[p.name for p in PATCHES + UNLANDED])
def test_pending_patch_applies(patch):
    result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"{patch.name} no longer applies: {result.stderr}"
