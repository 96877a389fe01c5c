"""One row of `rlrecipe doctor`: what the recipe needs, what the machine has, and a status."""

from __future__ import annotations

from dataclasses import dataclass

OK, FAIL, UNKNOWN = "ok", "FAIL", "cannot check here"
GB = 1e9
GIB = 2**30
# Filesystems a rollout node elsewhere can see the same files through.
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
             "wekafs", "panfs", "9p", "cifs", "smb3", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse", "virtiofs")


@dataclass
class Check:
    name: str
    need: str
    have: str
    status: str
    fatal: bool = False  # a FAIL here stops `rlrecipe sft` / `rlrecipe rl` at start

    @property
    def line(self) -> str:
        return f"{self.name}: needs {self.need}; this machine has {self.have}"
