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
    let block = row_block(n, min_units);
    (grid(rows), CubeDim::new_1d(block as u32), block)
}

/// Note [Softmax rows in registers] (LayerNorm's rows too, forward and backward: `kernels.rs`,
/// a cube per row): the attention's masked softmax rows are short (S = 128 or
/// 512 keys) and there are many of them (B·nh·S). Each unit used to stream its share of a row
/// three times: the scores for the maximum, again for the exponentials (written out), then the
/// exponentials back to normalise (written again); the backward read the gradient and the
/// probabilities twice. Where a unit's share is at most [`MAX_PER_UNIT`] elements, it now keeps
/// them in registers (a comptime-sized local array): the scores are read once and each output
/// written once, and the backward reads each input once, as Megatron's
/// `scaled_masked_softmax_warp_forward`/`_backward` (apex's fused softmax) do. With a cube per
/// row the sums are taken in the same order as the streaming form's, so in f32 the outputs are
/// the same bits (a plane per row, below, adds in another order: the same from run to run, not
/// the same bits as a cube's); in bf16 and f16 the exponentials are no longer rounded to the
/// storage type before the division (one rounding instead of two). LayerNorm keeps `y` as
/// stored (rounded to the storage type, as it was read back): the same bits in every dtype.
///
/// Where the row kernels reduce by planes and the device's planes have one fixed size `P`
/// (CUDA's warps of 32), a row of at most `P`·[`MAX_PER_UNIT`] elements (512 on CUDA) goes to
/// one plane instead of a cube, [`PLANE_ROWS_PER_CUBE`] rows per cube: its reductions are
/// plane operations alone, with no shared memory and no barrier (Megatron's warp per row, four
/// rows per 128 threads). A device whose plane size may vary (CubeCL's `plane_size_min` below
/// its `max`) keeps a cube per row: a row split across two planes would be summed in halves.
/// Longer rows keep the streaming form.
pub(super) const MAX_PER_UNIT: usize = 16;

/// Rows per cube of the plane-per-row softmax (Note [Softmax rows in registers]).
pub(super) const PLANE_ROWS_PER_CUBE: usize = 4;

/// How the softmax kernels lay `rows` rows of `n` elements out (Note [Softmax rows in
/// registers]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SoftmaxLayout {
    /// Units per cube.
    pub block: usize,
    /// Cubes in all (spread over a 2-D grid by [`grid`]).
    pub cubes: usize,
    /// Elements each unit holds in registers; 0: the streaming form.
    pub per_unit: usize,
    /// One plane per row (`PLANE_ROWS_PER_CUBE` rows per cube), else one cube per row.
    pub plane_rows: bool,
}

/// The layout for `rows` rows of `n` elements, given the row reductions' form (`planes`,
/// `min_units`: [`row_form`]) and the device's plane size where it is fixed.
pub(super) fn softmax_layout(
    rows: usize,
    n: usize,
    planes: bool,
    min_units: usize,
    fixed_plane: Option<usize>,
) -> SoftmaxLayout {
    if planes
        && let Some(plane) = fixed_plane
        && plane > 0
        && n.div_ceil(plane) <= MAX_PER_UNIT
    {
        return SoftmaxLayout {
            block: plane * PLANE_ROWS_PER_CUBE,
            cubes: rows.div_ceil(PLANE_ROWS_PER_CUBE).max(1),
            per_unit: n.div_ceil(plane).max(1),
            plane_rows: true,
        };
    }
    let block = row_block(n, min_units);
    SoftmaxLayout {
        block,
        cubes: rows.max(1),
        per_unit: registers_per_unit(n, block),
        plane_rows: false,
    }
}

/// Elements of a row of `n` each of a cube's `block` units holds in registers, or 0 where that
/// is more than [`MAX_PER_UNIT`] (the streaming form): the row kernels' `per_unit` with a cube
/// per row (the softmax's cube form, and LayerNorm forward and backward).
pub(super) fn registers_per_unit(n: usize, block: usize) -> usize {
    let per_unit = n.div_ceil(block.max(1)).max(1);
    if per_unit <= MAX_PER_UNIT {
        per_unit
    } else {
        0
    }
}

/// The softmax kernels' launch on `client` for `rows` rows of `n` elements: cube count and
/// dim, whether the reductions go through planes, and the layout.
pub(super) fn softmax_launch<R: CubeRuntime>(
    client: &ComputeClient<R>,
    rows: usize,
    n: usize,
) -> (CubeCount, CubeDim, bool, SoftmaxLayout) {
    let (planes, min_units) = row_form(client);
    let hardware = &client.properties().hardware;
    let fixed_plane = (hardware.plane_size_min == hardware.plane_size_max)
        .then_some(hardware.plane_size_max as usize);
    let layout = softmax_layout(rows, n, planes, min_units, fixed_plane);
    (
        grid(layout.cubes),
        CubeDim::new_1d(layout.block as u32),
        planes,
        layout,
    )
}

/// `cubes` cubes numbered `CUBE_POS_X + CUBE_POS_Y · CUBE_COUNT_X` (more than one grid
/// dimension holds still fit), spread evenly over the grid's rows: fewer than one cube per
/// row beyond `cubes` (the masked softmax of BERT-large at seq 512, batch 32, has 65,536 cubes
/// of four rows: a full first row of 65,535 would leave a second of 65,535 cubes with one row's
/// work, the others only returning).
fn grid(cubes: usize) -> CubeCount {
    let (x, y) = grid_dims(cubes);
    CubeCount::Static(x as u32, y as u32, 1)
}

/// `(x, y)` of [`grid`]: `y` the fewest rows of at most `MAX_GRID` cubes, `x` the cubes a row.
fn grid_dims(cubes: usize) -> (usize, usize) {
    let y = cubes.div_ceil(MAX_GRID).max(1);
    (cubes.div_ceil(y).max(1), y)
}

/// Units of a row kernel's cube for rows of `n` elements: `n` rounded up to a power of two,
/// at least `min_units` and at most `ROW_BLOCK`.
fn row_block(n: usize, min_units: usize) -> usize {
    n.next_power_of_two()
        .clamp(min_units.clamp(1, ROW_BLOCK), ROW_BLOCK)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_spread_their_cubes_evenly_over_rows() {
        for cubes in [
            1,
            255,
            MAX_GRID,
            MAX_GRID + 1,
            65_536,
            131_071,
            262_144,
            1 << 20,
        ] {
            let (x, y) = grid_dims(cubes);
            assert!(x <= MAX_GRID && x * y >= cubes, "{cubes}: {x} × {y}");
            // Fewer idle cubes than rows.
            assert!(x * y - cubes < y, "{cubes}: {x} × {y}");
        }
        assert_eq!(grid_dims(65_536), (32_768, 2));
        assert_eq!(grid_dims(MAX_GRID), (MAX_GRID, 1));
        assert_eq!(grid_dims(0), (1, 1));
    }

    #[test]
    fn softmax_rows_go_to_planes_where_a_fixed_plane_holds_them_in_registers() {
        // CUDA (warps of 32, planes): BERT's rows of 128 and 512 keys, one warp each, 4 and 16
        // elements per lane, four rows per cube.
        for (n, per_unit) in [(128, 4), (512, 16), (1, 1), (33, 2)] {
            let layout = softmax_layout(1000, n, true, 32, Some(32));
            assert_eq!(
                layout,
                SoftmaxLayout {
                    block: 128,
                    cubes: 250,
                    per_unit,
                    plane_rows: true
                },
                "n {n}"
            );
        }
        assert_eq!(softmax_layout(1001, 128, true, 32, Some(32)).cubes, 251);
        // Too long for a warp's registers: a cube per row, 256 units holding 3 each.
        let long = softmax_layout(10, 513, true, 32, Some(32));
        assert_eq!(
            (long.block, long.cubes, long.per_unit, long.plane_rows),
            (256, 10, 3, false)
        );
        // Beyond 256 · 16 elements: the streaming form.
        assert_eq!(softmax_layout(10, 4097, true, 32, Some(32)).per_unit, 0);
        assert_eq!(softmax_layout(10, 4096, true, 32, Some(32)).per_unit, 16);
    }

    #[test]
    fn layer_norm_rows_fit_registers_up_to_sixteen_elements_a_unit() {
        // BERT-base and -large at 256 units: 3 and 4 elements each.
        assert_eq!(registers_per_unit(768, 256), 3);
        assert_eq!(registers_per_unit(1024, 256), 4);
        assert_eq!(registers_per_unit(4096, 256), 16);
        assert_eq!(registers_per_unit(4097, 256), 0);
        assert_eq!(registers_per_unit(1, 1), 1);
        assert_eq!(registers_per_unit(33, 64), 1);
    }

    #[test]
    fn softmax_rows_keep_a_cube_without_planes_or_with_a_varying_plane() {
        for (planes, fixed) in [(false, Some(32)), (true, None)] {
            let layout = softmax_layout(7, 128, planes, if planes { 32 } else { 1 }, fixed);
            assert_eq!(
                layout,
                SoftmaxLayout {
                    block: 128,
                    cubes: 7,
                    per_unit: 1,
                    plane_rows: false
                }
            );
        }
        // A row shorter than a cube: the cube is n rounded up to a power of two (one element
        // each); seq 1 gets one unit on the tree.
        assert_eq!(softmax_layout(3, 13, false, 1, None).block, 16);
        assert_eq!(softmax_layout(3, 1, false, 1, None).block, 1);
    }
}
