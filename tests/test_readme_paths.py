"""Every repository file a doc, docstring or comment names exists (files move; their mentions must follow).

A mention is a path whose first folder is one of the repository's own top-level folders
(`harness/costmodel/compute.py`, `conf/hardware/h100_sxm.yaml`). Files a run writes (records under
results/, a calibrated profile under conf/hardware/local/) and files of other projects that happen to
start with one of our folder names (torchtitan's docs/performance.md) are listed below with the reason.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOP = ("harness", "lab", "conf", "docs", "tests", "models", "launch", "scripts", "hydra_plugins", "results")
MENTION = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]+\.(?:py|yaml|md|sh|jsonl|json\.gz|json\.xz|json|txt|toml|csv))\b" % "|".join(TOP))
WRITTEN_BY_RUNS = re.compile(r"^results/(?!reference/|README\.md)|^conf/hardware/local/")
# other projects' files, cited with their repository beside them
EXTERNAL = {
    "docs/performance.md": "pytorch/torchtitan's performance tables",
    "docs/performance-summary.md": "NVIDIA NeMo's performance summary",
    "docs/source/performance/performance_summary.md": "NVIDIA NeMo's performance summary",
    "scripts/train.sh": "foundation-model-stack/fms-fsdp's training script",
    "scripts/train/benchmarking/README.md": "mosaicml/llm-foundry's benchmark tables",
    "scripts/train/benchmarking/submit_benchmarks.py": "mosaicml/llm-foundry's benchmark launcher",
    "models/llama/__init__.py": "torchtitan/models/llama/__init__.py",
    "models/mpt/modeling_mpt.py": "llmfoundry/models/mpt/modeling_mpt.py",
    "scripts/scaling_benchmarks.py": "huggingface/nanotron's sweep launcher (the Playbook's runs)",
}


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml", "*.sh", "Makefile"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in out if (REPO / f).is_file()]


def test_every_repository_file_named_exists():
    missing = []
    for path in tracked_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in MENTION.findall(line):
                if "<" in name or WRITTEN_BY_RUNS.search(name) or name in EXTERNAL or (REPO / name).exists():
                    continue
                missing.append(f"{path.relative_to(REPO)}:{n}: {name}")
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)


# a module named by its path and one of its names (`harness/collect/aggregate.config_record`)
MODULE_NAME = re.compile(r"(?<![\w./-])((?:harness|lab|models|launch|hydra_plugins)(?:/\w+)+)\.([A-Za-z_]\w*)\b")
EXTENSIONS = {"py", "yaml", "md", "sh", "jsonl", "json", "txt", "toml", "html", "png", "csv"}


def test_every_module_named_with_one_of_its_names_exists():
    missing = []
    for path in tracked_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for module, name in MODULE_NAME.findall(line):
                if name not in EXTENSIONS and not ((REPO / f"{module}.py").exists() or (REPO / module).is_dir()):
                    missing.append(f"{path.relative_to(REPO)}:{n}: {module}.{name}")
    assert not missing, "modules named but not in the repository:\n" + "\n".join(missing)
    gone = "harness/collect/" + "repeats"  # a module that does not exist, apart so this line is no mention
    assert MODULE_NAME.findall(f"({gone}.config_record)") == [(gone, "config_record")]


def test_the_pattern_finds_a_mention_and_skips_a_url():
    assert MENTION.findall("see harness/costmodel/compute.py and conf/config.yaml") == \
        ["harness/costmodel/compute.py", "conf/config.yaml"]
    assert MENTION.findall("github.com/pytorch/torchtitan/docs/performance.md") == []


ANCHORED = re.compile(r"(?<![\w/-])((?:docs/|results/|\.\./)?[\w./-]*\.md)#([\w-]+)")


def anchors(md: Path) -> set[str]:
    """The ids a link can name in a markdown file: <a id>, {#id} and GitHub's heading slugs."""
    text = md.read_text()
    ids = set(re.findall(r'<a id="([\w-]+)"', text)) | set(re.findall(r"\{#([\w-]+)\}", text))
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        ids.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return ids


def test_every_section_a_doc_or_comment_links_to_exists():
    broken = []
    for path in tracked_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name, anchor in ANCHORED.findall(line):
                target = (path.parent / name) if not name.startswith(TOP) else REPO / name
                if name.startswith(("docs/", "results/")):
                    target = REPO / name
                if not target.resolve().is_relative_to(REPO) or not target.exists():
                    continue  # another project's file (a URL's tail), or a path the test above reports
                if anchor not in anchors(target):
                    broken.append(f"{path.relative_to(REPO)}:{n}: {name}#{anchor}")
    assert not broken, "links to sections that do not exist:\n" + "\n".join(broken)


# A doc says what is true now, by topic; when and in which session a figure was taken is git history.
NARRATIVE = re.compile(r"(?i)session of (the )?\d|session of 20\d\d|this session|the (last|next) session|\(evening\)")


def test_no_doc_carries_a_session_narrative():
    docs = [REPO / "README.md", REPO / "results" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [f"{d.relative_to(REPO)}:{n}: {line.strip()[:100]}" for d in docs
             for n, line in enumerate(d.read_text().splitlines(), 1) if NARRATIVE.search(line)]
    assert not found, "\n".join(found)


# Code says what is true now, as docs do: when a figure was taken (a month-day date) and which
# issue asked for the code are git history. Another project's issue cited with its repository stays
# (NVIDIA/nccl issue 1048); a full date beside a citation is not a session date (2022-07-25).
SESSION_DATE = re.compile(r"(?<![\d.-])1[12]-[0-3]\d(?![\d-])")
ISSUE = re.compile(r"(?i)\bissues? \d+")
CITED_ISSUE = re.compile(r"[\w.-]+/[\w.-]+\b")  # a repository named just before: its own issue


def code_narrative(line: str) -> list[str]:
    """What in a line of code or config is history rather than a fact: a session date, a project issue
    number, a session phrase."""
    out = ["session date"] if SESSION_DATE.search(line) else []
    out += ["issue number" for m in ISSUE.finditer(line) if not CITED_ISSUE.search(line[max(0, m.start() - 60):m.start()])]
    return out + (["session narrative"] if NARRATIVE.search(line) else [])


def test_no_code_comment_carries_a_date_an_issue_number_or_a_session():
    files = subprocess.run(["git", "ls-files", "*.py", "*.yaml", "*.sh", "Makefile", "*.toml"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    found = [f"{f}:{n}: {kind}: {line.strip()[:100]}" for f in files
             if (REPO / f).is_file() and f != "tests/test_readme_paths.py"  # the patterns themselves
             for n, line in enumerate((REPO / f).read_text(errors="replace").splitlines(), 1)
             for kind in code_narrative(line)]
    assert not found, "\n".join(found)


def test_the_code_check_sees_dates_and_issues_and_spares_citations():
    month_day, issue = "12" + "-02", "issue" + " 14"
    assert code_narrative(f"# measured {month_day} at load 2 ({issue})") == ["session date", "issue number"]
    assert code_narrative("# NVIDIA/nccl " + "issue 1048 (2022-07-25); pytorch/torchtitan pull request 135") == []


# notes.md and published.md are references by topic: no clock time of a measurement, no numbered step of a
# piece of work, no profile named by when it was made (cpu_s7, #s9-cpu) instead of the machine it describes,
# no first person outside a quotation. The log of held-out looks is docs/heldout_log.md, labelled as a log.
REFERENCE_DOCS = ("docs/notes.md", "docs/published.md")
NOT_A_REFERENCE = {
    "clock time": re.compile(r"\b\d{1,2}:\d{2}\b"),
    "step number": re.compile(r"(?i)\bsteps? \d+\b(?!\.\d)"),
    "numbered profile": re.compile(r"cpu_(?:s|q)\d+|cpu_vm\b|#s\d+-cpu"),
    "first person": re.compile(r"\bI(?:'[a-z]+)? (?=[a-z])|\b(?:[Mm]y|[Mm]e|[Ww]e|[Oo]ur)\b"),  # not I = 2MNK / B
}


def reference_doc_faults(text: str) -> list[str]:
    """What in `text` makes it a diary, not a reference (quoted text excepted: a source may say "we")."""
    unquoted = re.sub(r'"[^"]*"', lambda m: "\n" * m.group().count("\n"), text)  # a quotation may span lines
    return [f"{n}: {kind}: {line.strip()[:100]}" for n, line in enumerate(unquoted.splitlines(), 1)
            for kind, rx in NOT_A_REFERENCE.items() if rx.search(line)]


def test_reference_docs_carry_no_clock_times_step_numbers_or_numbered_profiles():
    found = [f"{doc}:{fault}" for doc in REFERENCE_DOCS for fault in reference_doc_faults((REPO / doc).read_text())]
    assert not found, "\n".join(found)


def test_the_reference_check_sees_a_diary():
    diary = "Calibration s7 at 10:16 (step 9): cpu_s7, see #s9-cpu. I kept it.\nThe file says \"we used 500 W\"."
    kinds = [f.split(": ")[1] for f in reference_doc_faults(diary)]
    assert kinds == ["clock time", "step number", "numbered profile", "first person"]
