"""A small code-editing workload for tests: a function, a request for a revised copy, its first line.

Self-contained (it does not need `python -m benchmarks.workloads` to have run) and short, so a CPU
mesh serves it in seconds; the output repeats the prompt, so n-gram drafts get accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

FUNCTIONS = [
    "def moving_average(values, window):\n"
    "    total = 0.0\n"
    "    averages = []\n"
    "    for index, value in enumerate(values):\n"
    "        total += value\n"
    "        if index >= window:\n"
    "            total -= values[index - window]\n"
    "        averages.append(total / min(index + 1, window))\n"
    "    return averages\n",
    "def count_words(text):\n"
    "    counts = {}\n"
    "    for word in text.split():\n"
    "        word = word.strip('.,;:!?').lower()\n"
    "        if word:\n"
    "            counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n",
    "def flatten(nested):\n"
    "    flat = []\n"
    "    for item in nested:\n"
    "        if isinstance(item, list):\n"
    "            flat.extend(flatten(item))\n"
    "        else:\n"
    "            flat.append(item)\n"
    "    return flat\n",
]


def write_smoke_workload(path: Path, num_requests: int = 6, max_tokens: int = 24) -> Path:
    with path.open("w", encoding="utf-8") as out:
        for i in range(num_requests):
            function = FUNCTIONS[i % len(FUNCTIONS)]
            prompt = f"{function}\n\n# The same function with type hints:\n{function.splitlines()[0][:-1]}"
            record = {
                "id": f"smoke-{i}",
                "workload": "code_editing",
                "prompt": prompt,
                "max_tokens": max_tokens,
            }
            out.write(json.dumps(record) + "\n")
    return path
