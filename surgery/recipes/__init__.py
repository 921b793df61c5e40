"""YAML recipes: a source, ordered steps (convert / check / uptrain / check / push) and an output folder.

- `schema.py`   the pydantic schema (step options derived from the CLI commands) and line-aware loading.
- `runner.py`   runs the steps as CLI commands, records finished steps, skips unchanged ones, `--from`.
- `plan.py`     `--dry-run`: the plan with sizes, tokens and memory; `estimate.py` holds the formulas.
"""

from .schema import Recipe, load_recipe, recipe_from_data

__all__ = ["Recipe", "load_recipe", "recipe_from_data"]
