"""Slurm job dependencies (``sbatch --dependency``) in Lattice's vocabulary.

Why: ``#SBATCH --dependency=afterok:123`` chains jobs; Lattice expresses the same with
``depends_on`` edges (``{ref, condition}``, the DAG conditions success / failure / any /
corresponding) and a mutex for Slurm's ``singleton``. Forms without a Lattice meaning
fail here, with a hint, instead of silently changing when a job starts.

Translated::

    afterok:ID[:ID...]     -> success        afternotok:ID... -> failure
    afterany:ID[:ID...]    -> any            aftercorr:ID...  -> corresponding
    singleton              -> mutex (no refs; the mutex name is the job name)
    ID  (Slurm's old bare form, meaning afterany:ID) -> any

``,`` joins clauses that must all hold, which is exactly a list of ``depends_on`` edges.
Refused, each with a hint: ``?`` (any one clause suffices; Lattice dependencies are all
required, so there is no OR), ``after`` (start of the other job), ``afterburstbuffer``,
``expand``, ``+time`` delays (Lattice has no "N minutes after" edge), and unknown types.
Job ids are Slurm numbers or Lattice allocation ids (letters, digits, ``-``), optionally
with an array index, ``123_4``; they are returned as written (see :func:`split_job_ref`).
Types are matched case-insensitively.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from lattice_common.slurm.errors import SlurmSyntaxError

CONDITIONS: dict[str, str] = {
    "afterok": "success",
    "afternotok": "failure",
    "afterany": "any",
    "aftercorr": "corresponding",
    "singleton": "mutex",
}
_UNSUPPORTED: dict[str, str] = {
    "after": "Lattice starts a job after another one ends, not when it starts; use "
    "afterany:ID to wait for it to finish.",
    "afterburstbuffer": "Lattice has no burst buffers; use afterany:ID, and data.mounts "
    "with tier_hint: hot for staging.",
    "expand": "Lattice allocations do not grow into other jobs; submit a separate "
    "allocation (reactive scaling covers elastic workloads).",
}
MAX_TEXT = 10_000
_JOB_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,127}(?:_([0-9]{1,10}))?\Z")
_HINT = "Use e.g. --dependency=afterok:123:456,afterany:789 (all must hold) or singleton."


class DependencyClause(NamedTuple):
    """One ``type:id[:id...]`` clause: a Lattice condition and the job refs it names."""

    condition: str
    refs: tuple[str, ...]


def _error(message: str, hint: str = _HINT) -> SlurmSyntaxError:
    return SlurmSyntaxError(message, hint=hint)


def _ref(text: str, clause: str) -> str:
    if "+" in text:
        raise _error(
            f"time delays ({text!r} in {clause!r}) are not supported",
            hint="Drop the +MINUTES suffix; Lattice dependencies have no delay.",
        )
    if not _JOB_REF.match(text):
        raise _error(f"invalid job id {text!r} in dependency {clause!r}")
    return text


def _clause(part: str) -> DependencyClause:
    if not part.strip():
        raise _error("empty clause in --dependency (stray ',' or '?')")
    kind, sep, rest = part.partition(":")
    key = kind.strip().lower()
    if not sep:
        if key == "singleton":
            return DependencyClause("mutex", ())
        if key in CONDITIONS or key in _UNSUPPORTED:
            raise _error(f"dependency {part!r} names no job")
        # Slurm's old form: a bare job id means afterany:ID.
        return DependencyClause("any", (_ref(part.strip(), part),))
    if key in _UNSUPPORTED:
        raise _error(f"dependency type {key!r} is not supported by Lattice", _UNSUPPORTED[key])
    if key not in CONDITIONS:
        raise _error(
            f"unknown dependency type {kind!r} in {part!r}",
            hint="Known types: " + ", ".join(CONDITIONS) + ".",
        )
    if key == "singleton":
        raise _error(f"singleton takes no job ids: {part!r}", hint="Write just singleton.")
    refs = tuple(_ref(r.strip(), part) for r in rest.split(":"))
    return DependencyClause(CONDITIONS[key], refs)


def parse_dependency(text: str) -> list[DependencyClause]:
    """``"afterok:123:456,afterany:789"`` ->
    ``[("success", ("123", "456")), ("any", ("789",))]``, clauses in written order.

    Raises :class:`SlurmSyntaxError` for malformed text and unsupported forms.
    """
    s = str(text).strip()
    if not s:
        raise _error("--dependency is empty")
    if len(s) > MAX_TEXT:
        raise _error(f"--dependency value is too long ({len(s)} characters)")
    if "?" in s:
        if "," in s:
            raise _error(f"dependency {s!r} mixes ',' (all of) and '?' (any of)")
        if len([p for p in s.split("?") if p.strip()]) > 1:
            raise _error(
                f"dependency {s!r} uses '?' (any one suffices), which Lattice does not "
                "support: all of a job's dependencies must hold",
                hint="Use ',' if every dependency must hold, or restructure as a DAG "
                "(lattice dag submit) with 'any' edges.",
            )
        s = s.replace("?", "")
    return [_clause(part) for part in s.split(",")]


def split_job_ref(ref: str) -> tuple[str, int | None]:
    """``"123_4"`` -> ``("123", 4)``; ``"a1b2c3d4"`` -> ``("a1b2c3d4", None)``."""
    m = _JOB_REF.match(str(ref))
    if not m:
        raise _error(f"invalid job id {ref!r}")
    if m.group(1) is None:
        return str(ref), None
    return str(ref).rpartition("_")[0], int(m.group(1))


def to_depends_on(
    clauses: list[DependencyClause], *, mutex_name: str | None = None
) -> list[dict[str, str]]:
    """Lattice ``depends_on`` edges, ``[{"ref": "123", "condition": "success"}, ...]``.

    A ``mutex`` clause (``singleton``) becomes ``{"ref": mutex_name, "condition":
    "mutex"}`` and needs ``mutex_name`` (Slurm uses the job name).
    """
    edges: list[dict[str, str]] = []
    for clause in clauses:
        if clause.condition == "mutex":
            if not mutex_name:
                raise _error(
                    "singleton needs a job name to use as the mutex name",
                    hint="Give the job a name (--job-name / --name).",
                )
            edges.append({"ref": mutex_name, "condition": "mutex"})
        else:
            edges.extend({"ref": ref, "condition": clause.condition} for ref in clause.refs)
    return edges
