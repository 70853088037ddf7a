"""The emulator's Step Functions parses each state machine definition on its own, as Step Functions does."""

from __future__ import annotations

import json
import threading

import pytest
from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser

from trainstack.emulator.server import isolate_definition_parses

pytestmark = pytest.mark.fast

# A JSONPath Choice (the supervisor's definitions are full of them) ...
VALID = {
    "StartAt": "Pick",
    "States": {
        "Pick": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.reason", "StringEquals": "launch", "Next": "Done"}],
            "Default": "Done",
        },
        "Done": {"Type": "Succeed"},
    },
}
# ... and a definition refused while its parse is inside a JSONata state (Parameters is JSONPath-only).
REFUSED_INSIDE_JSONATA = {
    "StartAt": "Shape",
    "States": {"Shape": {"Type": "Pass", "QueryLanguage": "JSONata", "Parameters": {"a": 1}, "End": True}},
}


def parse(definition: dict) -> None:
    AmazonStateLanguageParser.parse(json.dumps(definition))


def test_a_refused_definition_does_not_make_later_valid_ones_refused() -> None:
    isolate_definition_parses()
    with pytest.raises(ValueError, match="Unsupported declaration"):
        parse(REFUSED_INSIDE_JSONATA)
    parse(VALID)  # before the fix: "Unsupported declaration in QueryLanguage=JSONPath block: "Variable"..."


def test_definitions_parsed_on_many_threads_at_once_all_parse() -> None:
    isolate_definition_parses()
    errors: list[BaseException] = []

    def parse_many() -> None:
        for _ in range(20):
            try:
                parse(VALID)
                with pytest.raises(ValueError):
                    parse(REFUSED_INSIDE_JSONATA)
            except BaseException as error:  # noqa: BLE001 - collected, asserted below
                errors.append(error)

    threads = [threading.Thread(target=parse_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
