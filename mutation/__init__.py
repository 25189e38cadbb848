"""The structure-aware mutation run: only typed refusals may come out.

The format target, every golden vector through the readers (mutation/format_target.py):

    .venv/bin/python -m mutation --mutants 50000 --seed 1 [--jobs 2] [--json out.json]

Inputs: every vector under spec/vectors/ — each ``*.hsnap``, of each snapshot
directory its ``manifest.json`` and every rank file, and of each page store (spec 5.10)
every page object (examined by its own reader, spec 5.11, and through the references of
the paged vectors beside it, spec 7.6). Mutant ``i`` is a pure function of
(seed, i): pair ``i // 2`` draws a target and one operator (or, one time in seven, a
stack of 2-4), and ``i % 2`` picks the variant — 0 *raw* (bytes changed, every check
left stale), 1 *re-signed* (every integrity field recomputed as the mutated bytes lay
the file out: preamble check, header digest, each table digest, root digest, trailer
check, the manifest's digest line and, for a rank of a directory, its manifest entry),
so that the mutant passes the integrity layers and reaches the structural and semantic
checks behind them. Operators: bit flips, interesting bytes and integers (preamble and
trailer fields), truncation, extension, chunk deletion/duplication/insertion/copy, and
header-JSON-aware edits (numbers as huge/negative/float/300-400-digit/non-canonical
literals, type changes, list entries of other types (``features.optional``...), added,
removed and duplicated keys, deep nesting, escapes and invalid UTF-8, swaps, copies,
raw text edits).

Each mutant runs in a worker process (at most ``--jobs``; a per-mutant time limit; the
address space limited by RLIMIT_AS): ``hsnap_format.open``, ``verify()``, ``record()``
(and ``record(verify=False)``), every section through ``array()`` (plain and
verified), the pread paths (``section_bytes``/``read`` where the reader has them),
``section_stats`` (plain and verified) and ``snapshot_summary``; on every
``--cli-every``-th mutant also ``diff_snapshots`` against the vector and the CLI
(``info``, ``info --json``, ``verify``, ``verify --json``, ``diff``). Classes:

  typed               refused with an HsnapError subclass                    ok
  accepted-unchanged  accepted, and its bytes are the vector's               ok
  accepted-valid      re-signed, accepted, different, and a spec-valid file: ok
                      the reference writer, given the decoded content, writes
                      the same file (up to what the spec lets differ: unknown
                      keys where readers ignore them, absent keys that have a
                      default, the minor version, auto-listed optional features)
  accepted-but-changed  raw: accepted with bytes other than the vector's;    FAILURE
                      re-signed: accepted but not spec-valid — the writer
                      refuses it or writes something else ("non-canonical"),
                      or tests/independent_reader.py (written from the spec
                      alone) refuses it: the writer validates with the
                      reader's own code, so a rule both skip needs a second
                      opinion (its known deviations: INDEPENDENT_DEVIATIONS)
  untyped             any other exception (KeyError, TypeError, OverflowError, FAILURE
                      MemoryError, RecursionError...), or the worker died
  hang                over the time limit                                    FAILURE
  cli-disagrees       ``hsnap verify`` exit status differs from the library   FAILURE
  spec-disagrees      refused by hsnap_format, but tests/independent_reader.py FAILURE
                      (the spec alone) accepts it, or refuses it at open with
                      another error class (7.1's order is normative)
  harness-error       the harness failed (not the library)                   FAILURE

The exit status is 1 when any FAILURE count is non-zero. The first few failures of
each class (distinct stack locations) are minimized (ops dropped and shrunk while the
failure stays the same) and saved, with the bytes, under ``--findings`` (default
/tmp/mutate-findings/seed<S>/); ``--replay DIR/case.json`` reruns one with its
traceback. No pickle: workers get indices or JSON and answer JSON lines.

``--target http`` (mutation/http_routes.py): one live server with the plug-in and a snapshot root, ``--mutants``
generated bodies over every ``/hsnap/*`` route and hostile migration container files, a bystander stream beside
them; counts server deaths, untyped 500s, hangs past the route's bound, files created outside the root, planted
non-snapshot bytes echoed, and bystander streams cut (each a FAILURE).

Other targets, ``--target reshard,resume,retract,gc,gc-url,migrate,chain,compact`` (or
``new``, or ``all`` with ``format``; mutation/targets.py and, for migrate and chain,
mutation/migrate.py, for compact mutation/compact.py hold their seeds, operators and oracles):

    .venv/bin/python -m mutation --target new --mutants 5000 --url-mutants 1000 --jobs 2

  reshard   snapshot sets exported from SGLang's own pools at TP 1, 2, 4 (a Qwen3.5-like GDN
            hybrid, GQA, MLA, Mamba2, an SWA model with evicted window rows), one rank or the
            manifest mutated (per-rank bookkeeping, sharding parts, identity, record, section
            bytes, a rank rewritten with another swa_start or state_position), restored with
            ``restore_request(dir, sharding=describe(model, M, r))`` for every M != N
  resume    Req snapshots (greedy, sampled, logprobs top-k, xgrammar, SWA, Mamba, MLA, paged;
            written by snapshot_req) through ``resume_req``: sglang.* extras malformed, deeply
            nested, of other types, huge, unknown enum names; sampling values; ids outside
            the vocabulary
  retract   the same through ``load_retracted`` with the Req SGLang's retraction left
  gc        directories mixing committed snapshots (plain names, temporary-looking names,
            in marked staging directories, behind links) and leftovers in every state,
            renamed, moved, truncated, re-marked; ``gc.collect(remove=True, older_than=0)``
            (or by pid), ``hsnap gc --remove`` every ``--cli-every``-th
  gc-url    the same on a SeaweedFS this script starts, ``s3://`` prefixes and siblings,
            multipart uploads in progress (``--url-mutants`` of them)
  migrate   a live migration written by MigrationSource over SGLang's pools (and one across TP
            sizes: set links of a TP-1 source followed by each rank of a TP-2 target); a MigrationTarget
            applies k correct links, then meets a hostile link k through apply / step / follow
            (bytes of its header, record, sections, digests mutated; another request's, model's,
            geometry's or migration's link; the same link twice, one skipped, the plain one again;
            a final whose output ids do not extend; truncated, missing; abandoned.json; the
            caller's accept refusing): typed with pools and free lists byte-identical and the
            correct links still applying to the source's request, or accepted with exactly what
            the accepted link says
  chain     restore_request of a chain's head (a migration's links, a checkpoint directory's
            newest link by newest_links, a TP-2 chain of set directories) with a link anywhere
            below it mutated (re-signed: the links above re-based on it), removed, swapped or a
            stray newer checkpoint added
  compact   compact_path of the chain target's mutants and of paged chains (a page reference
            re-pointed at another page's object, its key or digest alone, pages fields, a page
            object mutated, removed, swapped, or re-signed under its new name and re-pointed at):
            refused typed with nothing left under the output's name, or an output that holds
            byte for byte what the restore of the same head puts in the pools (compact-laundered:
            compacted a chain the restore refuses; accepted-wrong-bytes; refused-left-output)

Target pools are filled with a sentinel byte in every free row and reused (put back from
the harness's own copy after each mutant). Classes (FAILURE unless typed or accepted):
typed (and the pools byte-identical), accepted (every check held; migrate and chain say
accepted-unchanged or accepted-valid), untyped, hang, leaked-slots, pool-changed,
req-changed, accepted-uncovered, accepted-ranks-disagree, uninitialised-uploaded,
accepted-unwritten, accepted-wrong-bytes, accepted-wrote-elsewhere, accepted-slot-accounting,
accepted-invalid-req, committed-removed, cli-failed, accepted-but-changed, not-resumable,
harness-error (mutation/targets.py and mutation/migrate.py say what each means).
Counts per target and overall; findings
minimized under ``--findings``/seed<S>/<target>/, replayed with ``--replay``.

Layout: run.py (the worker pool, tallies, minimization and the command line that
__main__.py runs), format_target.py (the golden vectors through the readers), targets.py
(reshard, resume, retract, gc, gc-url, and the pools, classes and helpers every SGLang
target shares), migrate.py (migrate, chain), compact.py (compact), http_routes.py (http).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the suite's helpers the targets build on (craft, chain_cases, io_cases, seaweed, independent_reader) live in tests/
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
