"""regions.yaml's `batch` section: the Files and Batch APIs (router.batch)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class BatchConfig(BaseModel):
    """The Files and Batch APIs (router.batch): where files are kept, and the limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    max_lines: int = Field(
        default=50_000, ge=1, le=1_000_000,
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
    lease_s: float = Field(
        default=30.0, ge=1.0, le=3600.0,
        description="a replica holds the lines it runs for this long, renewing it while it "
        "runs them; a replica that dies has its lines run by another after this long")

    @field_validator("storage")
    @classmethod
    def _known_storage(cls, storage: str) -> str:
        if storage == "local" or storage.startswith(("file:///", "s3://", "gs://")):
            return storage
        raise ValueError("'local', file:///absolute/path, s3://bucket[/prefix] or "
                         "gs://bucket[/prefix]")
