"""django-ninja names each schema in the OpenAPI document by its class name, and two classes
of one name silently become one: the document then describes one response with the
other's fields. Every schema class of the API therefore has a name of its own."""

from __future__ import annotations

from ninja import Schema


def test_every_api_schema_class_has_a_name_of_its_own() -> None:
    import dipaco_server.api  # noqa: F401 (imports every router and its schemas)

    modules: dict[str, set[str]] = {}
    stack = list(Schema.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith(("dipaco_server", "dipaco_web")):
            modules.setdefault(cls.__name__, set()).add(cls.__module__)
    assert len(modules) > 20
    shared = {name: sorted(where) for name, where in modules.items() if len(where) > 1}
    assert not shared, f"rename one of each: {shared}"
