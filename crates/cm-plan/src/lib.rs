//! The analytical mask compiler: from a checked program and its parameters to the exact
//! visible key intervals of every query row ([`RowIntervals`]) and the tile descriptor
//! ([`TileDescriptor`]) that kernels consume.

pub mod rows;
pub mod tiles;

pub use rows::{KeyInterval, RowIntervals};
pub use tiles::{TileCounts, TileDescriptor, TileShape};
