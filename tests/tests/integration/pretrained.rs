//! Starting from another BERT's weights (`ember_model::WeightsFile`, `load_pretrained`):
//! a Hugging Face `BertForPreTraining` (the parity fixture made by
//! `tests/fixtures/make_hf_parity.py`) loads whole and exports to the same tensors, a
//! `BertModel` file fills the encoder and leaves the heads initialised and listed, and bad
//! files are refused naming the file, the tensor and both shapes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use ember_model::{BertConfig, BertForPreTraining, WeightsFile};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

type B = NdArray;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf_tiny_bert")
}

fn model() -> BertForPreTraining<B> {
    BertConfig::load_json(&fixture().join("config.json"))
        .unwrap()
        .init_for_pretraining(&Default::default())
}

/// Every tensor of a safetensors file: name → (shape, bytes).
fn tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.shape().to_vec(), view.data().to_vec())))
        .collect()
}

fn write(path: &Path, tensors: &BTreeMap<String, (Vec<usize>, Vec<u8>)>) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, (shape, data))| {
            (
                name.clone(),
                TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn a_hugging_face_checkpoint_loads_whole_and_exports_the_same_tensors() {
    let file = WeightsFile::find(&fixture()).unwrap();
    assert_eq!(
        file,
        WeightsFile::Safetensors(fixture().join("model.safetensors"))
    );
    let (model, report) = model().load_pretrained(&file).unwrap();
    assert!(report.initialised.is_empty(), "{:?}", report.initialised);
    let original = tensors(file.path());
    assert_eq!(report.loaded.len(), original.len());

    let dir = tempfile::tempdir().unwrap();
    let exported = dir.path().join("model.safetensors");
    model.save_hf_safetensors(&exported).unwrap();
    let exported = tensors(&exported);
    assert_eq!(
        exported.keys().collect::<Vec<_>>(),
        original.keys().collect::<Vec<_>>()
    );
    for (name, tensor) in &original {
        assert!(
            exported[name] == *tensor,
            "{name} changed on the round trip"
        );
    }
}

#[test]
fn a_bert_model_file_fills_the_encoder_and_lists_the_heads_it_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let encoder: BTreeMap<_, _> = tensors(&fixture().join("model.safetensors"))
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix("bert.").map(|k| (k.to_string(), v)))
        .collect();
    let path = dir.path().join("encoder.safetensors");
    write(&path, &encoder);
    let (model, report) = model()
        .load_pretrained(&WeightsFile::find(&path).unwrap())
        .unwrap();
    assert_eq!(report.loaded.len(), encoder.len());
    let mut heads = report.initialised.clone();
    heads.sort();
    assert_eq!(
        heads,
        [
            "cls.predictions.bias",
            "cls.predictions.transform.LayerNorm.bias",
            "cls.predictions.transform.LayerNorm.weight",
            "cls.predictions.transform.dense.bias",
            "cls.predictions.transform.dense.weight",
            "cls.seq_relationship.bias",
            "cls.seq_relationship.weight",
        ]
    );
    // The encoder holds the file's values.
    let saved = dir.path().join("saved.safetensors");
    model.save_hf_safetensors(&saved).unwrap();
    let saved = tensors(&saved);
    for (name, tensor) in &encoder {
        assert!(saved[&format!("bert.{name}")] == *tensor, "{name}");
    }
}

#[test]
fn bad_weights_files_are_refused_naming_file_tensor_and_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let error = |path: &Path| {
        let file = WeightsFile::find(path)?;
        model().load_pretrained(&file).map(|_| ())
    };
    let original = tensors(&fixture().join("model.safetensors"));

    // Not BERT at all.
    let path = dir.path().join("other.safetensors");
    let mut other = BTreeMap::new();
    other.insert("conv1.weight".to_string(), (vec![2], vec![0u8; 8]));
    write(&path, &other);
    let e = error(&path).unwrap_err().to_string();
    assert!(
        e.contains("other.safetensors") && e.contains("not a BERT checkpoint"),
        "{e}"
    );
    assert!(e.contains("conv1.weight"), "{e}");

    // A tensor of another shape: named, with both shapes.
    let path = dir.path().join("shape.safetensors");
    let mut wrong = original.clone();
    wrong.insert(
        "bert.pooler.dense.bias".into(),
        (vec![16], vec![0u8; 16 * 4]),
    );
    write(&path, &wrong);
    let e = error(&path).unwrap_err().to_string();
    assert!(
        e.contains("bert.pooler.dense.bias") && e.contains("[16]") && e.contains("[32]"),
        "{e}"
    );

    // A tensor the model has no place for.
    let path = dir.path().join("extra.safetensors");
    let mut extra = original.clone();
    extra.insert(
        "bert.encoder.layer.2.output.dense.bias".into(),
        (vec![32], vec![0u8; 32 * 4]),
    );
    write(&path, &extra);
    let e = error(&path).unwrap_err().to_string();
    assert!(
        e.contains("no place for") && e.contains("encoder.layer.2.output.dense.bias"),
        "{e}"
    );

    // Missing file and a folder without weights.
    let e = error(&dir.path().join("missing.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.safetensors"), "{e}");
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = error(&empty).unwrap_err().to_string();
    assert!(
        e.contains("empty") && e.contains("model.safetensors"),
        "{e}"
    );
}

/// The same model saved by PyTorch (`torch.save` of the state dict with the tied decoder,
/// `tests/fixtures/make_pytorch_bin.py`) loads to the same weights as its safetensors file.
#[test]
fn a_pytorch_model_bin_loads_to_the_same_weights() {
    let bin = fixture().with_file_name("hf_tiny_bert_bin");
    let file = WeightsFile::find(&bin).unwrap();
    assert_eq!(file, WeightsFile::PyTorch(bin.join("pytorch_model.bin")));
    let (from_bin, report) = model().load_pretrained(&file).unwrap();
    assert!(report.initialised.is_empty(), "{:?}", report.initialised);
    assert_eq!(report.loaded.len(), 46);
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("model.safetensors");
    from_bin.save_hf_safetensors(&saved).unwrap();
    let (original, saved) = (
        tensors(&fixture().join("model.safetensors")),
        tensors(&saved),
    );
    assert_eq!(original.len(), saved.len());
    for (name, tensor) in &original {
        assert!(saved[name] == *tensor, "{name} differs");
    }
}
