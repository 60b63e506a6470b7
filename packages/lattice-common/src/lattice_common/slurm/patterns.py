"""sbatch ``--output``/``--error`` filename patterns: ``slurm-%A_%4a.out`` -> a name.

Why: Lattice keeps logs in its log store, but ``--output`` still names the download path
(and what users expect ``lattice logs`` to save as), so the pattern must expand the way
Slurm would. Never raises: any text is a valid template.

Fields (Slurm's ``expand_stdio_fields`` for batch jobs)::

    %j job id   %J job id (batch step)   %A array master id (the job id if not an array)
    %a array index (4294967294, Slurm's NO_VAL, if not an array)   %b index modulo 10
    %x job name %u user   %N first node's short host name   %n node index (0)
    %t task id (0)   %s step (``batch``)   %% a literal %

A number between ``%`` and the letter zero-pads numeric fields (``%4a`` -> ``0007``; at
most 10; ignored for text fields such as ``%N``). Unknown fields are kept as written
(``%q`` stays ``%q``, ``%4q`` stays ``%4q``); so is a trailing ``%`` (Slurm drops it).
If the template contains a backslash, nothing is expanded and the backslashes are
removed (``\\\\`` becomes one ``\\``), as Slurm's ``remove_path_slashes`` does.
"""

from __future__ import annotations

NO_ARRAY_INDEX = 4294967294
MAX_PADDING = 10
_NUMERIC = set("jJAabnt")
_TEXT = set("xuNs")


def _unescape(template: str) -> str:
    out = []
    i = 0
    while i < len(template):
        ch = template[i]
        if ch == "\\":
            if template[i + 1 : i + 2] == "\\":
                out.append("\\")
                i += 2
                continue
            i += 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _padding(digits: str) -> int:
    significant = digits.lstrip("0")
    if len(significant) > 2:  # avoid int() on huge digit strings
        return MAX_PADDING
    return min(int(significant or "0"), MAX_PADDING)


def expand_output_pattern(
    template: str,
    *,
    job_id: str | int,
    job_name: str = "",
    user: str = "",
    array_job_id: str | int | None = None,
    array_index: int | None = None,
    node: str = "",
    node_index: int = 0,
    task_id: int = 0,
    step: str = "batch",
) -> str:
    """Expand ``template`` for one job (see the module docstring for the fields)."""
    template = str(template)
    if "\\" in template:
        return _unescape(template)
    index = NO_ARRAY_INDEX if array_index is None else int(array_index)
    values = {
        "j": str(job_id),
        "J": str(job_id),
        "A": str(job_id if array_job_id is None else array_job_id),
        "a": str(index),
        "b": str(index % 10),
        "n": str(node_index),
        "t": str(task_id),
        "x": str(job_name),
        "u": str(user),
        "N": str(node).split(".", 1)[0],
        "s": str(step),
    }
    out: list[str] = []
    i, n = 0, len(template)
    while i < n:
        ch = template[i]
        if ch != "%":
            out.append(ch)
            i += 1
            continue
        j = i + 1
        while j < n and template[j].isascii() and template[j].isdigit():
            j += 1
        digits = template[i + 1 : j]
        field = template[j] if j < n else ""
        if field == "%" and not digits:
            out.append("%")
            i = j + 1
        elif field in _NUMERIC:
            out.append(values[field].rjust(_padding(digits), "0") if digits else values[field])
            i = j + 1
        elif field in _TEXT:
            out.append(values[field])
            i = j + 1
        else:  # unknown field, or a trailing % / %NN: keep as written
            out.append(template[i:j])
            i = j
    return "".join(out)
