//! How the row kernels (LayerNorm forward and backward, masked softmax forward and backward)
//! reduce a row across the units of their cube: a tree in shared memory, or planes (warps on
//! CUDA) first.
//!
//! Note [Row reductions]: a row kernel gives one cube to a row (up to 256 units); each unit
//! folds its strided share of the row, and the cube then combines the units' values. The tree
//! (`cube_sum`, `cube_max`) halves the active units through shared memory with a barrier per
//! level: log₂(units) + 1 barriers per reduction, 9 at 256 units. At BERT's shapes each unit
//! folds only 1–4 elements (softmax rows of 128 at seq 128 give one element per unit), so the
//! barriers, not the memory traffic, set the kernel's time; on an H200 the fused softmax took
//! 0.71× the time of Burn's composition at BERT-large seq 128, LayerNorm's backward 0.66–0.76×
//! at seq 512 (docs/gpu.md). apex's LayerNorm (`cuWelfordMuSigma2`, `cuComputeGradInput`) and
//! Megatron's fused softmax (`scaled_masked_softmax_warp_forward`) reduce within a warp first,
//! by shuffles in registers, and meet across warps in shared memory once. The plane form here
//! does the same: `plane_sum`/`plane_max` within each plane, the planes' results in shared
//! memory, each unit folding them in plane order: two barriers per reduction at any width. A
//! cube then has at least one whole plane ([`row_form`]): CUDA's shuffles read every lane of a
//! warp, so a row shorter than 32 still gets 32 units, the idle ones folding nothing.
//! Both forms give every unit the same total, in an order fixed for a given device and cube
//! size (a kernel's output repeats bit for bit from run to run). LayerNorm's backward needs two
//! sums of each row (Σg and Σg·x̂, apex's `cuComputeGradInput` reduces them together too):
//! [`row_sum_pair`] takes both through one reduction, each in `row_sum`'s order (the same
//! totals), with half the barriers: two in all with planes instead of four, nine with the
//! tree at 256 units instead of eighteen.
//!
//! `RowReductions::Auto` (`kernels_choice.rs`) takes planes where CubeCL reports plane operations (CUDA) and the
//! tree elsewhere. CubeCL does not report them for CPU devices, so lavapipe runs the tree
//! by default; lavapipe does run subgroup operations (planes of 8 units), which is how CI
//! tests the plane form (`RowReductions::Planes` forces it; `bench kernels --row-reductions` compares the two).

use burn_cubecl::CubeRuntime;
use cubecl::ir::features::Plane;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

use super::{MAX_GRID, ROW_BLOCK};
use crate::{RowReductions, row_reductions};

/// Whether the row kernels launched on `client` reduce through planes.
fn planes<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    match row_reductions() {
        RowReductions::Planes => true,
        RowReductions::Tree => false,
        RowReductions::Auto => client.properties().features.plane.contains(Plane::Ops),
    }
}

/// The row kernels' reduction on `client` and the fewest units their cube may have: with
/// planes, one whole plane (CUDA's shuffles read every lane of a warp, and in a cube narrower
/// than a warp some lanes do not exist: a row shorter than 32, such as attention at a short
/// sequence, still gets a cube of 32 units, the idle ones folding nothing); with the tree, one.
pub(super) fn row_form<R: CubeRuntime>(client: &ComputeClient<R>) -> (bool, usize) {
    let planes = planes(client);
    let min_units = if planes {
        client.properties().hardware.plane_size_max as usize
    } else {
        1
    };
    (planes, min_units)
}

/// Cube count, cube dim and block size for `rows` rows of `n` elements, one cube per row of at
/// least `min_units` units ([`row_form`]).
pub(super) fn row_launch(rows: usize, n: usize, min_units: usize) -> (CubeCount, CubeDim, usize) {
    let block = n
        .next_power_of_two()
        .clamp(min_units.clamp(1, ROW_BLOCK), ROW_BLOCK);
    let x = rows.clamp(1, MAX_GRID);
    let y = rows.div_ceil(x).max(1);
    (
        CubeCount::Static(x as u32, y as u32, 1),
        CubeDim::new_1d(block as u32),
        block,
    )
}

/// Sum of `value` over the units of the cube, by a tree in `shared` (one slot per unit;
/// `CUBE_DIM_X` a power of two); every unit gets the total.
#[cube]
pub(super) fn cube_sum(shared: &mut SharedMemory<f32>, value: f32) -> f32 {
    let unit = UNIT_POS_X as usize;
    shared[unit] = value;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if unit < stride {
            shared[unit] = shared[unit] + shared[unit + stride];
        }
        sync_cube();
        stride /= 2;
    }
    let total = shared[0];
    sync_cube();
    total
}

/// Sums of `a` and of `b` over the units of the cube, by one tree in `shared` (two slots per
/// unit: `a`'s in the first `CUBE_DIM_X`, `b`'s after): [`cube_sum`]'s additions in its order
/// for each, with half its barriers per sum.
#[cube]
fn cube_sum_pair(shared: &mut SharedMemory<f32>, a: f32, b: f32) -> (f32, f32) {
    let unit = UNIT_POS_X as usize;
    let dim = CUBE_DIM_X as usize;
    shared[unit] = a;
    shared[dim + unit] = b;
    sync_cube();
    let mut stride = dim / 2;
    while stride > 0 {
        if unit < stride {
            shared[unit] = shared[unit] + shared[unit + stride];
            shared[dim + unit] = shared[dim + unit] + shared[dim + unit + stride];
        }
        sync_cube();
        stride /= 2;
    }
    let totals = (shared[0], shared[dim]);
    sync_cube();
    totals
}

/// Maximum of `value` over the units of the cube, by a tree in `shared`; every unit gets it.
#[cube]
fn cube_max(shared: &mut SharedMemory<f32>, value: f32) -> f32 {
    let unit = UNIT_POS_X as usize;
    shared[unit] = value;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if unit < stride {
            let other = shared[unit + stride];
            if other > shared[unit] {
                shared[unit] = other;
            }
        }
        sync_cube();
        stride /= 2;
    }
    let total = shared[0];
    sync_cube();
    total
}

/// The index of the unit's plane in the cube (planes are consecutive units of a 1-D cube).
#[cube]
fn plane_index() -> usize {
    (UNIT_POS_X / PLANE_DIM) as usize
}

/// How many planes the cube has.
#[cube]
fn plane_count() -> usize {
    ((CUBE_DIM_X + PLANE_DIM - 1) / PLANE_DIM) as usize
}

/// Sum of `value` over the units of the cube: `plane_sum` in each plane, the planes' sums in
/// `shared`, folded by every unit in plane order (two barriers).
#[cube]
fn plane_cube_sum(shared: &mut SharedMemory<f32>, value: f32) -> f32 {
    let partial = plane_sum(value);
    if UNIT_POS_PLANE == 0 {
        shared[plane_index()] = partial;
    }
    sync_cube();
    let mut total = shared[0];
    for p in 1..plane_count() {
        total += shared[p];
    }
    // Every unit has read the slots before the next reduction writes them.
    sync_cube();
    total
}

/// Sums of `a` and of `b` over the units of the cube, as [`plane_cube_sum`] for each, their
/// planes' sums in `shared` side by side (`b`'s from slot `CUBE_DIM_X`): two barriers for both.
#[cube]
fn plane_cube_sum_pair(shared: &mut SharedMemory<f32>, a: f32, b: f32) -> (f32, f32) {
    let dim = CUBE_DIM_X as usize;
    let partial_a = plane_sum(a);
    let partial_b = plane_sum(b);
    if UNIT_POS_PLANE == 0 {
        shared[plane_index()] = partial_a;
        shared[dim + plane_index()] = partial_b;
    }
    sync_cube();
    let mut total_a = shared[0];
    let mut total_b = shared[dim];
    for p in 1..plane_count() {
        total_a += shared[p];
        total_b += shared[dim + p];
    }
    sync_cube();
    (total_a, total_b)
}

/// Maximum of `value` over the units of the cube, as [`plane_cube_sum`].
#[cube]
fn plane_cube_max(shared: &mut SharedMemory<f32>, value: f32) -> f32 {
    let partial = plane_max(value);
    if UNIT_POS_PLANE == 0 {
        shared[plane_index()] = partial;
    }
    sync_cube();
    let mut total = shared[0];
    for p in 1..plane_count() {
        let other = shared[p];
        if other > total {
            total = other;
        }
    }
    sync_cube();
    total
}

/// Sum of `value` over the units of the cube, by planes or by the tree (Note [Row
/// reductions]); every unit gets the total.
#[cube]
pub(super) fn row_sum(shared: &mut SharedMemory<f32>, value: f32, #[comptime] planes: bool) -> f32 {
    if planes {
        plane_cube_sum(shared, value)
    } else {
        cube_sum(shared, value)
    }
}

/// Sums of `a` and of `b` over the units of the cube in one reduction, by planes or by the
/// tree, each in the order [`row_sum`] adds it (the same totals, bit for bit), with half the
/// barriers of two `row_sum`s; `shared` holds two slots per unit (`2 · CUBE_DIM_X`). Every
/// unit gets both totals.
#[cube]
pub(super) fn row_sum_pair(
    shared: &mut SharedMemory<f32>,
    a: f32,
    b: f32,
    #[comptime] planes: bool,
) -> (f32, f32) {
    if planes {
        plane_cube_sum_pair(shared, a, b)
    } else {
        cube_sum_pair(shared, a, b)
    }
}

/// Maximum of `value` over the units of the cube, by planes or by the tree; every unit gets it.
#[cube]
pub(super) fn row_max(shared: &mut SharedMemory<f32>, value: f32, #[comptime] planes: bool) -> f32 {
    if planes {
        plane_cube_max(shared, value)
    } else {
        cube_max(shared, value)
    }
}
