"""Instruction data as chat conversations, for training draft heads and building n-gram tries.

Reads the formats of ../shared/data/train (see its README):
    .json   a list of {"instruction", "input", "response" | "output"}
    .jsonl  rows of {"prompt", "completion"} (T0), {"instruction", "instances": [{"input", "output"}]}
            (Self-Instruct), {"instruction", "input", "response" | "output"}, {"text"}, or ShareGPT's
            {"conversations": [{"from": "human" | "gpt" | "system", "value"}]}
    .txt    documents separated by blank lines
Each record becomes a list of chat messages (a {"text"} row or a .txt document becomes one
assistant-free user turn, i.e. plain text; see `render`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

Messages = list[dict]


def _turn(instruction: str, inp: str | None) -> str:
    inp = (inp or "").strip()
    return f"{instruction.strip()}\n\n{inp}" if inp else instruction.strip()


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant", "system": "system"}


def _from_sharegpt(turns: list, where: str) -> Messages:
    """A ShareGPT conversation ([{from: human|gpt|system, value}]) as chat messages. Turns of other
    speakers are an error; a conversation is cut before its first empty turn."""
    messages = []
    for k, turn in enumerate(turns):
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None or not isinstance(turn.get("value"), str):
            raise ValueError(f"{where}: turn {k} is not {{from: human|gpt|system, value: str}}: {sorted(turn)}")
        if not turn["value"].strip():
            break
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _from_record(row: dict, where: str) -> Iterator[Messages | str]:
    if "conversations" in row and isinstance(row["conversations"], list):
        messages = _from_sharegpt(row["conversations"], where)
        if any(m["role"] == "user" for m in messages):
            yield messages
    elif "text" in row and isinstance(row["text"], str):
        yield row["text"]
    elif "prompt" in row and "completion" in row:
        yield [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    elif "instances" in row and "instruction" in row:
        for inst in row["instances"]:
            yield [
                {"role": "user", "content": _turn(row["instruction"], inst.get("input"))},
                {"role": "assistant", "content": inst.get("output", "")},
            ]
    elif "instruction" in row and ("response" in row or "output" in row):
        answer = row.get("response", row.get("output"))
        yield [{"role": "user", "content": _turn(row["instruction"], row.get("input"))}, {"role": "assistant", "content": answer}]
    else:
        raise ValueError(f"{where}: unrecognised record with keys {sorted(row)}")


def iter_records(path: str | Path) -> Iterator[Messages | str]:
    """Conversations (message lists) or plain texts from one data file, in file order."""
    path = Path(path)
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of records")
        for i, row in enumerate(rows):
            yield from _from_record(row, f"{path}[{i}]")
    elif path.suffix == ".jsonl":
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield from _from_record(json.loads(line), f"{path}:{lineno}")
    elif path.suffix == ".txt":
        for doc in path.read_text().split("\n\n"):
            if doc.strip():
                yield doc.strip()
    else:
        raise ValueError(f"{path}: unsupported data file (expected .json, .jsonl or .txt)")


def render(tokenizer, record: Messages | str) -> list[int]:
    """Token ids of a record as the target sees it: the chat template for conversations (so the
    template's own tokens and the end-of-turn token are part of the data), plain text otherwise."""
    if isinstance(record, str):
        ids = tokenizer(record, add_special_tokens=False)["input_ids"]
        return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    text = tokenizer.apply_chat_template(record, tokenize=False, enable_thinking=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
