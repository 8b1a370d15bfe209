"""Sub-token tables: for an ordered pair of tokenizers (src, dst), the dst token chain of
every src id (spec section 3). Build with :func:`build_table`, store with :func:`save_table`,
read with :func:`load_table`, check with :func:`validate_pair`, and derive the CSD lookups with
:class:`TablePair`."""

from crosskd.tables.build import build_table
from crosskd.tables.format import Flag, SubTokenTable, TableMeta, load_table, save_table
from crosskd.tables.lookups import TablePair, chain_indices, common_tokens, load_table_pair
from crosskd.tables.validate import ValidationReport, validate_pair, validate_table

__all__ = [
    "Flag",
    "SubTokenTable",
    "TableMeta",
    "TablePair",
    "ValidationReport",
    "build_table",
    "chain_indices",
    "common_tokens",
    "load_table",
    "load_table_pair",
    "save_table",
    "validate_pair",
    "validate_table",
]
