"""What the client raises."""

from typing import Any


class ZerotrainError(Exception):
    """A 4xx/5xx answer: `status`, `title`, `detail`, `field` (or None) and the whole `problem`
    (the server's application/problem+json body)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.title: str = problem.get("title", "error")
        self.detail: str = problem.get("detail", "")
        self.field: str | None = problem.get("field")
        where = f" [{self.field}]" if self.field else ""
        super().__init__(f"{self.title} ({status}){where}: {self.detail}")


class ArtifactError(Exception):
    """A download that cannot be trusted or placed: a size or SHA-256 that differs from the
    listing, a name that would land outside the target folder, or a wanted artifact missing."""
