"""Store.make_readable on a folder that ranks of a sharded commit write at once: a file
renamed away between the walk and its chmod (another rank's temporary) is passed over,
every file still there is made 0644, and folders 0755. Seen in the suite as an FSDP
resume that died with FileNotFoundError on '.tmp-…-.rank-1'."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gagpo.storage.store import Store


def test_a_file_renamed_away_during_the_walk_is_passed_over(tmp_path: Path, monkeypatch):
    folder = tmp_path / "store" / "learner" / "checkpoints" / "v3"
    folder.mkdir(parents=True)
    kept = folder / "trainer.rank-0.pt"
    kept.write_bytes(b"x")
    kept.chmod(0o600)
    walk = os.walk

    def walk_then_another_rank_renames(path):
        for folder_, dirs, files in walk(path):
            yield folder_, dirs, [*files, ".tmp-0123-.rank-1"]  # listed, then renamed away

    monkeypatch.setattr(os, "walk", walk_then_another_rank_renames)
    Store(str(tmp_path / "store")).make_readable(str(folder))
    assert stat.S_IMODE(kept.stat().st_mode) == 0o644
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
