"""``vllm-patches diagnose``: the series' bugs, found in vLLM logs, one finding a line.

Policy is data: ``symptoms.toml`` names each symptom, the log lines it is made of, what it
means (wrong answers, capacity, a crash, a late start-up) and the fixes that remove it; a
fix's slug, releases and ``upstream_since`` come from its own metadata. It is one file,
not a ``[[symptoms]]`` table in each fix's TOML, because a symptom is not one fix's: the
same pair of producer lines is removed by F6, F7 or F8 depending on what held the decoder,
the kvcached hang belongs to no fix. Here is the mechanism: reading logs (files, ``-`` for stdin, gzip),
kubectl's prefixes, one engine per log or per kubectl pod, and a rule per symptom that
correlates its lines (pairs, order, siblings, times). An unknown line is no finding.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tomllib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from itertools import chain
from typing import TYPE_CHECKING, BinaryIO

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_patches._catalog.series import PACKAGE_DIR, specifier_set
from vllm_patches._errors import UserError

if TYPE_CHECKING:
    from vllm_patches._catalog.series import Fix

SYMPTOMS = PACKAGE_DIR / "symptoms.toml"
# A CPU tier pinned in more than this before the engine is ready is a finding: F4's
# measurement pins 64 GiB in 11.5 s on an H100 host, so a minute is a tier of hundreds of
# GB, the size where the background pin pays.
PIN_SLOW_S = 60.0
SNIFF_BYTES = 8192
CHUNK_BYTES = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"

# ------------------------------------------------------------------------------ reading

# kubectl logs --prefix: "[pod/NAME/CONTAINER] "; --timestamps: an RFC 3339 time. vLLM's
# process prefixes ("(EngineCore_DP0 pid=123) ", "(Worker_TP1 pid=124) ") and whatever
# VLLM_LOGGING_PREFIX adds need no stripping: signatures are searched anywhere in a line.
_POD = re.compile(r"\[pod/(?P<pod>[^/\]]+)(?:/[^\]]*)?\] ")
_RFC3339 = re.compile(r"(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)?) ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# vLLM's own stamp: "WARNING 08-16 08:09:07 [worker.py:2967] ", milliseconds optional.
_VLLM_STAMP = re.compile(r"\b(?P<md>\d\d-\d\d) (?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)? \[")


@dataclass(frozen=True)
class Line:
    """One log line without kubectl's prefixes: the pod that logged it, when (seconds,
    from kubectl's stamp or vLLM's; None without either) and the text."""

    pod: str
    seconds: float | None
    text: str


def strip(raw: str) -> Line:
    """``raw`` without kubectl's prefixes (pod, timestamp), in whichever order they come."""
    text = _ANSI.sub("", raw.rstrip("\r\n"))
    pod = ""
    stamp = None
    while True:
        if match := _POD.match(text):
            pod = match["pod"]
        elif match := _RFC3339.match(text):
            stamp = match["ts"]
        else:
            break
        text = text[match.end():]
    return Line(pod, _seconds(text, stamp), text)


def _seconds(text: str, rfc3339: str | None) -> float | None:
    """kubectl's stamp (every line of a pod has one), else vLLM's (month-day, no year:
    only differences within a log count)."""
    if rfc3339:
        return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1",
                                             rfc3339.replace("Z", "+00:00"))).timestamp()
    if match := _VLLM_STAMP.search(text):
        return datetime.strptime(f"2000-{match['md']} {match['hms']}",
                                 "%Y-%m-%d %H:%M:%S").timestamp()
    return None


@contextmanager
def _opened(name: str) -> Iterator[BinaryIO]:
    """Log ``name``'s bytes (``-``: stdin), decompressed if gzip (told by its content)."""
    try:
        stream = nullcontext(sys.stdin.buffer) if name == "-" else open(name, "rb")  # noqa: SIM115
    except IsADirectoryError:
        raise UserError(f"{name}: a directory, not a log") from None
    except OSError as exc:
        raise UserError(f"{name}: cannot read: {exc.strerror or exc}") from None
    with stream as raw:
        yield gzip.GzipFile(fileobj=raw) if raw.peek(2)[:2] == GZIP_MAGIC else raw


def read(name: str) -> Iterator[str]:
    """The lines of log ``name``, read as they come (a log may be gigabytes); a log it
    cannot read (binary, empty, a damaged gzip) is a UserError (bad input)."""
    with _opened(name) as stream:
        try:
            head = stream.read(SNIFF_BYTES)
            if b"\0" in head:
                raise UserError(f"{name}: binary, not a text log")
            rest, blank = b"", True
            for chunk in chain([head], iter(lambda: stream.read(CHUNK_BYTES), b"")):
                *whole, rest = (rest + chunk).split(b"\n")
                for raw in whole:
                    blank = blank and not raw.strip()
                    yield raw.decode("utf-8", "replace")
        except (OSError, EOFError) as exc:  # a damaged gzip file: BadGzipFile, EOFError
            raise UserError(f"{name}: cannot read: {exc}") from None
    if rest.strip():
        yield rest.decode("utf-8", "replace")
    elif blank:
        raise UserError(f"{name}: empty, no log lines to read")


# ------------------------------------------------------------------------------ engines


@dataclass(frozen=True)
class Match:
    index: int  # the line's position in its log: the order of an engine's lines
    line: Line
    req: str | None
    count: int | None


@dataclass
class Engine:
    """One engine's log: a file, or a pod's lines in kubectl's output, with the matches of
    each kind of line in ``symptoms.toml``'s ``[lines]``."""

    name: str
    matches: dict[str, list[Match]] = field(default_factory=lambda: defaultdict(list))
    release: str | None = None
    fix_line: str | None = None

    @property
    def version(self) -> Version | None:
        try:
            return Version(self.release) if self.release else None
        except InvalidVersion:
            return None

    @property
    def active(self) -> set[str] | None:
        """The fixes the plugin's line says are active (or already in the source tree);
        None without the line (a patched checkout logs none: unknown)."""
        if self.fix_line is None:
            return None
        ids: set[str] = set()
        for group in re.finditer(r"(?:^|[:;] )(?:active|already in the source tree): "
                                 r"(?P<ids>[^;]*)", self.fix_line):
            ids.update(part.strip() for part in group["ids"].split(",") if part.strip() != "none")
        return ids

    def requests(self, kind: str) -> dict[str, list[Match]]:
        by_request: dict[str, list[Match]] = defaultdict(list)
        for match in self.matches[kind]:
            by_request[match.req].append(match)
        return by_request


def engines(name: str, lines: Iterable[str], patterns: dict[str, re.Pattern]) -> list[Engine]:
    """The engines of one log: one per kubectl pod, or the log itself. A line that none of
    ``patterns`` matches is passed over before its prefixes are read (most of a log)."""
    # The patterns as one, less their named groups (a name may recur in several).
    anything = re.compile("|".join(f"(?:{re.sub(r'[(][?]P<[a-z_]+>', '(?:', p.pattern)})"
                                   for p in patterns.values()))
    found: dict[str, Engine] = {}
    for index, raw in enumerate(lines):
        if not anything.search(raw):
            continue
        line = strip(raw)
        engine = found.setdefault(line.pod, Engine(f"{name}[{line.pod}]" if line.pod else name))
        for kind, pattern in patterns.items():
            if (match := pattern.search(line.text)) is None:
                continue
            groups = match.groupdict()
            req = groups.get("req")
            number = groups.get("count") or groups.get("size")
            if kind == "release":
                engine.release = engine.release or req or groups.get("version")
            elif kind == "fix_set":
                engine.fix_line = line.text[match.start():]
            engine.matches[kind].append(Match(index, line, req, int(number) if number else None))
    return list(found.values())


# ------------------------------------------------------------------------------ rules

_CHILD = re.compile(r"(?P<index>\d+)_(?P<parent>.+)")


def parent_of(req: str) -> str | None:
    """The parent of a parallel-sampling child (``f"{index}_{parent}"``, vLLM's
    ParentRequest.get_child_info), else None."""
    match = _CHILD.fullmatch(req)
    return match["parent"] if match else None


@dataclass
class Hit:
    requests: list[str]
    lines: int
    note: str = ""
    # The symptom's fixes that can have removed what this log shows (None: all of them).
    fixes: frozenset[str] | None = None


def _hit(matches: list[Match], note: str = "", fixes: frozenset[str] | None = None) -> Hit | None:
    if not matches:
        return None
    requests = list(dict.fromkeys(m.req or "" for m in matches))
    return Hit([r for r in requests if r], len(matches), note, fixes)


def _invalid_after_expiry(engine: Engine) -> tuple[list[Match], list[Match]]:
    """The invalid-KV lines whose request expired with 0 reads earlier in the log, and
    the others."""
    expired_at = {req: min(m.index for m in ms if m.count == 0)
                  for req, ms in engine.requests("expired").items()
                  if any(m.count == 0 for m in ms)}
    after, other = [], []
    for match in engine.matches["invalid"]:
        late = match.req in expired_at and expired_at[match.req] < match.index
        (after if late else other).append(match)
    return after, other


def read_after_lease(engine: Engine, symptom: Symptom) -> Hit | None:
    """Expired with 0 reads, then read; of a request of n = 1, only ``single`` fixes."""
    after, _ = _invalid_after_expiry(engine)
    expired = [m for m in engine.matches["expired"] if m.req in {a.req for a in after}]
    children = any(parent_of(m.req) for m in after)
    return _hit(after + expired, fixes=None if children else symptom.single)


def read_after_release(engine: Engine, symptom: Symptom) -> Hit | None:
    _, other = _invalid_after_expiry(engine)
    return _hit([m for m in other if parent_of(m.req)])


def early_notification(engine: Engine, symptom: Symptom) -> Hit | None:
    _, other = _invalid_after_expiry(engine)
    return _hit([m for m in other if not parent_of(m.req)])


@dataclass
class ExpiredPrompt:
    """A pull prompt's expiry lines, its parallel-sampling siblings' together."""

    unread: list[Match]  # of the siblings that expired with 0 reads and no invalid-KV line
    read: bool  # a sibling expired after reads, has invalid-KV lines, or is missing
    siblings: bool  # a parallel-sampling prompt, not a request of n = 1


def expired_prompts(engine: Engine) -> list[ExpiredPrompt]:
    """Every prompt with expiry lines, and whether any of it was read. A sibling missing
    from the expired was released by its read, which upstream does not log."""
    invalid = {m.req for m in engine.matches["invalid"]}
    read_parents = {parent_of(req) for req in invalid}
    by_prompt: dict[str, dict[int | None, list[Match]]] = defaultdict(lambda: defaultdict(list))
    for match in engine.matches["expired"]:
        child = _CHILD.fullmatch(match.req)
        by_prompt[child["parent"] if child else match.req][
            int(child["index"]) if child else None].append(match)
    prompts = []
    for prompt, members in by_prompt.items():
        unread = [m for ms in members.values()
                  if all(m.count == 0 for m in ms) and ms[0].req not in invalid for m in ms]
        indices = {i for i in members if i is not None}
        missing = bool(indices) and bool(set(range(max(indices) + 1)) - indices)
        read = len({m.req for m in unread}) < len(members) or missing \
            or prompt in read_parents
        prompts.append(ExpiredPrompt(unread, read, bool(indices)))
    return prompts


def stranded_siblings(engine: Engine, symptom: Symptom) -> Hit | None:
    """Siblings expired unread while another sibling of their prompt was read. A prompt
    whose siblings all expired unread was never decoded: only the lease frees it, no
    bug (``unread_to_abort_timeout`` where the lease is the abort timeout)."""
    if engine.matches["push_mode"]:
        return None
    return _hit([m for prompt in expired_prompts(engine)
                 if prompt.siblings and prompt.read for m in prompt.unread])


def push_expired(engine: Engine, symptom: Symptom) -> Hit | None:
    if not engine.matches["push_mode"]:
        return None
    return _hit([m for m in engine.matches["expired"] if m.count == 0])


def push_unrecognized(engine: Engine, symptom: Symptom) -> Hit | None:
    return _hit(engine.matches["push_unrecognized"])


def registration_timeout(engine: Engine, symptom: Symptom) -> Hit | None:
    return _hit(engine.matches["registration_timeout"])


# vLLM ends a request id in "-" and 8 hex digits of its own (input_processor's
# assign_request_id); a push producer pairs a registration with a prompt by the id less
# them (nixl/utils.py, get_base_request_id): the X-Request-Id and the prompt's index.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def retry_timed_out(engine: Engine, symptom: Symptom) -> Hit | None:
    """Registrations of other decode requests timed out after the first of their
    X-Request-Id did: the first stays parked on a stock producer, which pairs the
    retry's prompt with it, so the retry's own registration is never served."""
    first: dict[str, str] = {}
    retries = [m for m in engine.matches["registration_timeout"]
               if first.setdefault(_RANDOM_SUFFIX.sub("", m.req), m.req) != m.req]
    return _hit(retries)


def remote_block_ids(engine: Engine, symptom: Symptom) -> Hit | None:
    return _hit(engine.matches["remote_block_ids"])


def failed_write_assert(engine: Engine, symptom: Symptom) -> Hit | None:
    """The worker's assert on a receive it no longer tracks, in push mode: the
    producer took its own failed WRITE for a failed receive."""
    return _hit(engine.matches["recving_metadata"]) if engine.matches["push_mode"] else None


def failed_read_assert(engine: Engine, symptom: Symptom) -> Hit | None:
    """The same assert in pull mode: a decoder reported a request whose READ failed
    while another READ of it was in flight, and that READ's completion found it gone."""
    return None if engine.matches["push_mode"] else _hit(engine.matches["recving_metadata"])


def expired_in_a_burst(engine: Engine, symptom: Symptom) -> Hit | None:
    """Expiries of two or more prompts logged in the same second, on a release whose
    reaper stops at the first lease not yet expired: held behind it, they go together
    once it goes. A heuristic (prompts prefilled together expire together too), hence
    only where the release is known to reap that way."""
    if not _needed_on_release(engine, symptom):
        return None
    by_second: dict[float, list[Match]] = defaultdict(list)
    for match in engine.matches["expired"]:
        if match.line.seconds is not None:
            by_second[match.line.seconds].append(match)
    burst = [m for ms in by_second.values()
             if len({parent_of(m.req) or m.req for m in ms}) >= 2 for m in ms]
    return _hit(burst)


def unread_to_abort_timeout(engine: Engine, symptom: Symptom) -> Hit | None:
    """Pull prompts of which no sibling was read, expired: before v0.21 (no leases),
    held for the abort timeout. A heuristic (a client that never sent the decode request
    looks the same), hence only where the release is known to need the fix."""
    if engine.matches["push_mode"] or not _needed_on_release(engine, symptom):
        return None
    return _hit([m for prompt in expired_prompts(engine) if not prompt.read
                 for m in prompt.unread])


def _needed_on_release(engine: Engine, symptom: Symptom) -> bool:
    """Whether ``engine``'s release is known and one the symptom's fixes are needed on."""
    version = engine.version
    return version is not None and any(version in releases for releases in symptom.releases)


def slow_cpu_tier_pin(engine: Engine, symptom: Symptom) -> Hit | None:
    starts = [m for m in engine.matches["cpu_tier"] if m.line.seconds is not None]
    if not starts:
        return None
    ready = [m for m in engine.matches["ready"]
             if m.line.seconds is not None and m.index > starts[0].index]
    if not ready:
        return None
    took = ready[0].line.seconds - starts[0].line.seconds
    if took < PIN_SLOW_S:
        return None
    return Hit([], 1, f"{took:.0f} s from the CPU tier's allocation to ready "
                      f"(a finding from {PIN_SLOW_S:.0f} s)")


def kvcached_hang(engine: Engine, symptom: Symptom) -> Hit | None:
    sizes = [m.count for m in engine.matches["tensor_parallel"] if m.count]
    if not engine.matches["kvcached"] or engine.matches["ready"] or max(sizes, default=1) < 2:
        return None
    from vllm_patches._commands.doctor import KNOWN_BAD

    bad = next(bad for bad in KNOWN_BAD if bad.package == "kvcached")
    return Hit([], 1, f"tensor parallelism {max(sizes)}, no ready line: {bad.what}; fixed in "
                      f"kvcached {bad.fixed_in} ({bad.reference})")


RULES = {rule.__name__: rule for rule in (
    read_after_lease, read_after_release, early_notification, stranded_siblings,
    push_expired, push_unrecognized, registration_timeout, retry_timed_out, remote_block_ids,
    failed_write_assert, failed_read_assert, expired_in_a_burst, unread_to_abort_timeout,
    slow_cpu_tier_pin, kvcached_hang)}


# ------------------------------------------------------------------------------ symptoms


@dataclass(frozen=True)
class FixRef:
    """A fix a symptom names, from the series' metadata."""

    id: str
    slug: str
    option: str
    fix: Fix

    def on(self, engine: Engine) -> dict:
        """The fix in ``engine``: active there (None: the log does not say), needed on its
        release, upstream since."""
        active = engine.active
        state = {"id": self.id, "slug": self.slug, "option": self.option or None,
                 "active": None if active is None else self.id in active,
                 "upstream_since": None, "on_release": None}
        if self.fix.upstream_since:
            state["upstream_since"] = f"v{self.fix.upstream_since}"
        if engine.version is not None:
            state["on_release"] = str(self.fix.on(engine.version))
        return state


@dataclass(frozen=True)
class Symptom:
    id: str
    rule: str
    text: str
    harm: str
    why: str
    fixes: tuple[FixRef, ...]
    releases: tuple  # SpecifierSets: where each of its fixes is needed
    opt_in: bool  # its fix's option is off by default: the fix being active is not enough
    single: frozenset[str] | None  # the fixes that apply to a request of n = 1, if fewer
    # Fixes that remove the symptom on some releases only: their ranges there.
    only_on: dict[str, SpecifierSet] = field(default_factory=dict)

    def fixes_on(self, version: Version | None) -> tuple[FixRef, ...]:
        """The fixes that remove the symptom on ``version`` (unknown: those without
        ``only_on``)."""
        return tuple(ref for ref in self.fixes if ref.id not in self.only_on
                     or (version is not None and version in self.only_on[ref.id]))


def load_symptoms() -> tuple[dict[str, re.Pattern], list[Symptom]]:
    from vllm_patches._catalog import series as _series

    data = tomllib.loads(SYMPTOMS.read_text())
    fixes = {fix.id: fix for fix in _series.load().fixes}
    symptoms = []
    for entry in data["symptom"]:
        refs, ranges = [], []
        for fix_id in entry["fixes"]:
            fix = fixes[fix_id]
            refs.append(FixRef(fix_id, fix.slug, entry["options"][fix_id], fix))
            ranges.append(fix.describe_needed())
        symptoms.append(Symptom(entry["id"], entry["rule"], entry["text"], entry["harm"],
                                entry["why"], tuple(refs),
                                tuple(specifier_set(text) for text in ranges),
                                entry.get("opt_in", False),
                                frozenset(entry["single"]) if "single" in entry else None,
                                {fix_id: specifier_set(text)
                                 for fix_id, text in entry.get("only_on", {}).items()}))
    return {kind: re.compile(text) for kind, text in data["lines"].items()}, symptoms


# ------------------------------------------------------------------------------ findings


def find(engine: Engine, symptoms: list[Symptom]) -> list[dict]:
    """The findings in ``engine``'s log: a symptom shows, and not every fix that removes
    it on the engine's release is active there (the fixes leave traces that look like
    it: F7's notifications of a prompt it computed, the lease freeing a prompt nobody
    decodes)."""
    findings = []
    for symptom in symptoms:
        hit = RULES[symptom.rule](engine, symptom)
        if hit is None:
            continue
        fixes = [ref.on(engine) for ref in symptom.fixes_on(engine.version)
                 if hit.fixes is None or ref.id in hit.fixes]
        needed = [state for state in fixes if state["on_release"] in (None, "needed")]
        if needed and not symptom.opt_in and all(state["active"] for state in needed):
            continue
        findings.append({
            "log": engine.name, "symptom": symptom.id, "text": symptom.text,
            "harm": symptom.harm, "requests": len(hit.requests), "lines": hit.lines,
            "example": hit.requests[0] if hit.requests else None, "note": hit.note or None,
            "release": f"v{engine.release}" if engine.release else None,
            "fix_set": None if engine.active is None else sorted(engine.active),
            "fixes": fixes, "why": symptom.why})
    return findings


def _fix_words(state: dict) -> str:
    active = {True: "active", False: "not active", None: "active unknown"}[state["active"]]
    parts = [active] + ([f"option {state['option']}"] if state["option"] else [])
    if state["on_release"] and state["on_release"] != "needed":
        parts.append(state["on_release"])
    return f"{state['id']} {state['slug']} ({', '.join(parts)})"


def line(finding: dict) -> str:
    """A finding as one line: where, what, how often, on what, which fix, since when."""
    from vllm_patches._plural import count

    seen = (f"{count(finding['requests'], 'request')} in {count(finding['lines'], 'line')}"
            if finding["requests"] else count(finding["lines"], "line"))
    example = f", e.g. {finding['example']}" if finding["example"] else ""
    note = f" ({finding['note']})" if finding["note"] else ""
    release = finding["release"] or "release unknown"
    fix_set = ("fix set unknown (no vllm-patches line)" if finding["fix_set"] is None
               else "fixes active: " + (", ".join(finding["fix_set"]) or "none"))
    fixes = "; ".join(_fix_words(state) for state in finding["fixes"]) or "no fix of the series"
    upstream = [f"{s['id']} since {s['upstream_since']}" for s in finding["fixes"]
                if s["upstream_since"]]
    return (f"{finding['log']}: {finding['text']} [{finding['harm']}]: {seen}{example}{note}; "
            f"vLLM {release}, {fix_set}; fixed by {fixes}; upstream: "
            f"{', '.join(upstream) or 'not fixed'}")


def diagnose(names: list[str]) -> list[dict]:
    """Every finding in the logs ``names``; a log it cannot read is a UserError, before
    anything is printed."""
    if names.count("-") > 1:
        raise UserError("stdin (-) given more than once")
    patterns, symptoms = load_symptoms()
    logs = [engines("stdin" if name == "-" else name, read(name), patterns) for name in names]
    return [finding for log in logs for engine in log for finding in find(engine, symptoms)]


def report(names: list[str], as_json: bool) -> int:
    """Print the findings; 1 when there are any, 0 when none."""
    findings = diagnose(names)
    if as_json:
        print(json.dumps(findings, indent=2))
    else:
        for finding in findings:
            print(line(finding))
        if not findings:
            print(f"no known symptom in {', '.join(names)}")
    return 1 if findings else 0


def run(args: argparse.Namespace) -> int:
    return report(args.logs, args.json)
