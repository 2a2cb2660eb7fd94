"""Schemas, regexes and choices the structured-output tests run (tiny model and default model)."""

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "role": {"enum": ["admin", "guest"]}},
                 "required": ["id", "role"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 1, "maxItems": 4}},
        "required": ["scores"], "additionalProperties": False},
    "enum_and_bounds": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "level": {"type": "integer", "minimum": 0, "maximum": 10},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
        "required": ["color", "level", "ratio", "tag"], "additionalProperties": False},
    "list_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
        "required": ["k", "v"], "additionalProperties": False}},
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe later"]
