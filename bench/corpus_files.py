"""Write the practice corpus's files (bench/practice_corpus.json) from local git mirrors.

    python bench/corpus_files.py [--mirrors /work/.mirror] [--corpus /work/practice-corpus] [--manifest FILE]

Each entry's `path` and `extra_files` are taken at the entry's `commit` from the mirror of its
repository (`<mirrors>/<owner>+<name>/repo` or its `.git`, as the session's fetch tool leaves it) and written to
`<corpus>/<owner>__<name>/<path>`, the layout bench/practice.py reads. Repositories without a
mirror are listed at the end (fetch them, then run this again); nothing else is touched.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    parser.add_argument("--corpus", type=Path, default=Path("/work/practice-corpus"))
    parser.add_argument("--manifest", type=Path, action="append")
    args = parser.parse_args(argv)
    entries = []
    for manifest in args.manifest or [ROOT / "bench" / "practice_corpus.json"]:
        entries.extend(json.loads(manifest.read_text()))
    missing, written = set(), 0
    for entry in entries:
        git = args.mirrors / entry["repo"].replace("/", "+") / "repo"
        if (git / ".git").is_dir():  # fetch leaves some mirrors with a work-tree layout
            git = git / ".git"
        if not git.is_dir():
            missing.add(entry["repo"])
            continue
        dest = args.corpus / entry["repo"].replace("/", "__")
        for rel in [entry["path"], *entry.get("extra_files", [])]:
            data = subprocess.run(["git", f"--git-dir={git}", "show", f"{entry['commit']}:{rel}"],
                                  capture_output=True, check=False)
            if data.returncode:
                print(f"{entry['name']}: {rel} not at {entry['commit'][:10]}: {data.stderr.decode().strip()}",
                      file=sys.stderr)
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data.stdout)
            written += 1
    print(f"{written} files written under {args.corpus}")
    if missing:
        print("no mirror (fetch github:<repo>): " + " ".join(sorted(missing)))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
