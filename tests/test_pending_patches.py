"""The kernel changes kept in docs/pending/ (built here, waiting for a device run) still apply to the
committed kernels: a patch that no longer applies is stale and must be redone or deleted."""
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "docs" / "pending").glob("*.patch"))


def test_every_pending_patch_is_described():
    readme = (ROOT / "docs" / "pending" / "README.md").read_text()
    for patch in PATCHES:
        assert f"`{patch.name}`" in readme, f"{patch.name} is not in docs/pending/README.md"


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_pending_patch_applies(patch):
    result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"{patch.name} no longer applies: {result.stderr}"


UNLANDED = sorted((ROOT / "docs" / "unlanded").glob("*.patch"))


@pytest.mark.parametrize("patch", UNLANDED, ids=[p.name for p in UNLANDED])
def test_unlanded_branch_patch_applies(patch):
    """A change kept as a whole-tree patch (docs/kernels.md names each) still applies to main."""
    assert patch.name in (ROOT / "docs" / "kernels.md").read_text(), f"{patch.name} is not described in docs/kernels.md"
    result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"{patch.name} no longer applies: {result.stderr}"
