"""regions.yaml's `batch` section: the Files and Batch APIs (router.batch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The most lines `max_lines` may allow: a batch record that claims more was not written by
# a router (router.batch.record.well_formed).
MAX_LINES = 1_000_000


class BatchConfig(BaseModel):
    """The Files and Batch APIs (router.batch): where files are kept, and the limits."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    enabled: bool = Field(
        default=True, description="serve /v1/files and /v1/batches and run batches")
    storage: str = Field(
        default="local",
        description="where uploaded files and batch results are kept: 'local' (a directory "
        "on this machine: $GLOBALPOOL_FILES_DIR, else ~/.local/share/globalpool/files; "
        "replicas on other machines cannot read it), file:///absolute/path, "
        "s3://bucket[/prefix] or gs://bucket[/prefix] (credentials from the environment, "
        "as the cloud's own tools read them)",
    )
    max_file_bytes: int = Field(
        default=200 * 1024 * 1024, ge=1024, le=8 * 1024 * 1024 * 1024,
        description="largest file a client may upload (413 beyond it)")
    max_files_per_tenant: int = Field(
        default=10_000, ge=1, le=10_000_000,
        description="most files one tenant (one owner, without API keys) may keep stored, "
        "batch output and error files included; an upload beyond it is refused (429 "
        "file_limit_reached) until files are deleted")
    max_lines: int = Field(
        default=50_000, ge=1, le=MAX_LINES,
        description="most requests in one batch's input file (400 beyond it)")
    max_unfinished_per_tenant: int = Field(
        default=100, ge=1, le=100_000,
        description="most batches one tenant (one owner, without API keys) may have "
        "unfinished at once (429 beyond it)")
    max_in_flight: int = Field(
        default=512, ge=1, le=100_000,
        description="most batch lines one replica runs at once, whatever the heartbeats "
        "say is spare: bounds what a wrong or forged heartbeat (an absurd max_num_seqs) "
        "can make it send; raise it for a fleet with more spare slots than replicas x this")
    interactive_reserve: Literal["adaptive"] | float = Field(
        default="adaptive",
        description="what batch lines leave free on each worker for interactive requests: "
        "'adaptive' keeps free the peak of the worker's interactive load lately plus 2 "
        "slots, and a quarter of its slots after everything that runs "
        "(router.policy.batch_room); a number from 0 to 0.95 keeps that share of its slots "
        "free after everything that runs instead, whatever the interactive load does. 0.25 "
        "was the only rule before: more batch throughput, and interactive requests that "
        "find every slot taken wait for a batch line to end. Requests a client sends with "
        "x-globalpool-class: batch (they come when they come) keep a quarter, or this share")
    lease_s: float = Field(
        default=30.0, ge=1.0, le=3600.0,
        description="a replica holds the lines it runs for this long, renewing it while it "
        "runs them; a replica that dies has its lines run by another after this long")

    @property
    def fixed_reserve(self) -> float | None:
        """`interactive_reserve` as router.policy.batch_room reads it (None: adaptive)."""
        reserve = self.interactive_reserve
        return None if reserve == "adaptive" else float(reserve)

    @field_validator("interactive_reserve")
    @classmethod
    def _share(cls, reserve: str | float) -> str | float:
        if isinstance(reserve, float) and not 0.0 <= reserve <= 0.95:
            raise ValueError("'adaptive', or a share of each worker's slots from 0 to 0.95")
        return reserve

    @field_validator("storage")
    @classmethod
    def _known_storage(cls, storage: str) -> str:
        if storage == "local" or storage.startswith(("file:///", "s3://", "gs://")):
            return storage
        raise ValueError("'local', file:///absolute/path, s3://bucket[/prefix] or "
                         "gs://bucket[/prefix]")
