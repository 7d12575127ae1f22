"""The in-memory store of responses created with `store: true` (`previous_response_id`,
`GET` and `DELETE /v1/responses/{id}`), bounded in bytes (`--responses-store-bytes`).

Each entry holds the response object and the conversation's items (the earlier turns' and
this request's input items, then its output items), so a follow-up turn sees the whole
conversation, and `GET /v1/responses/{id}/input_items` lists what the response was given. An entry counts the bytes of its JSON; when the total passes the bound, the least
recently used entries (stored or read) are dropped first. An entry larger than the bound alone
is not kept."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.entrypoints.openai.responses_protocol import new_item_id, stored_size

DEFAULT_STORE_BYTES = 64 * 1024 * 1024
# OpenAI's id prefixes for the items a client sends without one.
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs", None: "msg"}


@dataclass(slots=True)
class StoredResponse:
    response: dict  # the response object, as created
    items: list[dict]  # the conversation: every input item so far, then this response's output items
    num_bytes: int
    num_input: int = 0  # items[:num_input] were the response's input (GET .../input_items)


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, items: list[dict], num_input: int = 0) -> bool:
        """Keep `response` under its id, with the conversation `items` (the first `num_input`
        its input; each given an id where it has none, as the input items list shows them);
        False if it alone is larger than the bound."""
        items = [item if "id" in item else {"id": new_item_id(_ID_PREFIX.get(item.get("type"), "item")), **item}
                 for item in items]
        entry = StoredResponse(response, items, stored_size(response) + stored_size(items), num_input)
        if entry.num_bytes > self.max_bytes:
            return False
        self.delete(response["id"])
        while self._entries and self.num_bytes + entry.num_bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= dropped.num_bytes
        self._entries[response["id"]] = entry
        self.num_bytes += entry.num_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True
