"""Chapter 4's chat-like trace: requests that share a "system prompt" (a play's opening) and differ in the user line.

Everything comes from assets/text/shakespeare.txt and a seed, so the shipped file
assets/traces/shared_prefix.json can be rebuilt exactly. The embedded model's tokenizer has one token
per character, so a system prompt of N characters is N tokens: the four system prompts (28, 48, 80
and 120 characters) fall differently on blocks of 8, 16 and 32 tokens, and the 28-character one is
shorter than a 32-token block, so at that block size it is never a hit.
"""

import json
import random
from pathlib import Path

from kvlab.paths import ASSETS_DIR

TEXT_PATH = ASSETS_DIR / "text" / "shakespeare.txt"
TRACE_PATH = ASSETS_DIR / "traces" / "shared_prefix.json"
SYSTEM_PROMPTS = (("MACBETH", 28), ("JULIUS CAESAR", 48), ("OTHELLO, THE MOOR OF VENICE", 80), ("THE TEMPEST", 120))


_PLAY_BOUNDARIES = {"THE END", "DRAMATIS PERSONAE", "PERSONS REPRESENTED"}


def _play_lines(lines: list[str], title: str) -> list[str]:
    """The play's lines, from its title line to its "THE END" or the next play's cast list."""
    start = lines.index(title)
    # Skip the play's own cast list heading, a few lines below its title.
    ends = (i for i in range(start + 20, len(lines)) if lines[i].rstrip(":").upper() in _PLAY_BOUNDARIES)
    return lines[start:next(ends, len(lines))]


def _is_dialogue(line: str) -> bool:
    # Speaker tags ("OTHELLO.") are upper case; stage directions start with a bracket or Enter/Exit.
    return (24 <= len(line) <= 64 and not line.isupper() and any(c.islower() for c in line)
            and not line.startswith(("[", "Enter", "Exit", "Exeunt", "ACT", "SCENE")))


def build_shared_prefix_trace(num_requests: int = 32, max_new_tokens: int = 24, seed: int = 0) -> dict:
    """System prompts (play openings) and requests "<system prompt>\\n<user line>\\n", one arrival every 2 steps."""
    lines = [line.strip() for line in TEXT_PATH.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(seed)
    systems, user_pools = [], []
    for title, length in SYSTEM_PROMPTS:
        play = _play_lines(lines, title)
        systems.append("\n".join(line for line in play if line)[:length])
        user_pools.append(sorted({line for line in play if _is_dialogue(line)}))
    requests = []
    for request_id in range(num_requests):
        system_id = rng.randrange(len(systems))
        user = rng.choice(user_pools[system_id])
        requests.append({"request_id": request_id, "arrival_step": 2 * request_id, "system_prompt_id": system_id,
                         "prompt": f"{systems[system_id]}\n{user}\n", "max_new_tokens": max_new_tokens})
    return {"seed": seed, "system_prompts": systems, "requests": requests}


def save_shared_prefix_trace(trace: dict, path: Path | str = TRACE_PATH) -> None:
    """Write the trace as indented JSON."""
    Path(path).write_text(json.dumps(trace, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def load_shared_prefix_trace(path: Path | str = TRACE_PATH) -> dict:
    """Read a trace written by save_shared_prefix_trace."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
