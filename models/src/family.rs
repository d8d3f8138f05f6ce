//! The extension point for model families.
//!
//! A family says three things, and everything else (offloading, sharding over devices,
//! device-map planning, the schedule, kept units, the reservation, generation and training)
//! exists once, in [`CausalLm`](crate::CausalLm) and [`Trainer`](crate::Trainer):
//! - which tensors the checkpoint has and how they group into units ([`Family::tensors`],
//!   [`Family::layout`]: embeddings, one unit per decoder layer, final norm, output head);
//! - how to build one decoder block from an acquired unit ([`Family::block`]);
//! - how a block runs with a KV cache it does not own ([`DecoderBlock::forward`]), and, for
//!   training, over a whole sequence ([`DecoderBlock::forward_train`]).
//!
//! The [`Config`] a family reads (the shapes every family shares, the family itself and the
//! family's own fields as read) is defined here with it; what a configuration implies (RoPE
//! frequencies, memory to reserve, FLOPs) is in [`crate::config`], reading an HF
//! `config.json` in [`crate::hf_config`]; the families this crate ships, and the registry that
//! finds one by a `config.json`'s `model_type` or `architectures`, are [`crate::families`].
//! An application's own decoder implements [`Family`] and is set on its [`Config`]; see the
//! crate docs and `examples/own_model.rs`.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use candle_offload::UnitGuard;
use candle_transformers::models::llama::Llama3RopeConfig;

use crate::layers::{KvCache, Linear, LinearWeight, Masks, Norm, Rope};

/// What a forward pass gives every block on one device.
pub struct StepCtx<'a> {
    /// Position of the first new token (the number already in the KV cache).
    pub index_pos: usize,
    /// RoPE tables on this device.
    pub rope: &'a Rope,
    /// Masks for this pass: `masks.get(window)`.
    pub masks: &'a Masks,
    /// Use the fused ops of `candle_offload::kernels` (RMSNorm with the residual add, SiLU · mul,
    /// RoPE of q and k) where a block can.
    pub fused: bool,
    /// A decode step being captured as a CUDA graph: `index_pos` held on the device (one
    /// u32), which the attention's kernels read instead, so that each replay runs at the
    /// position written there. A block that cannot read it fails the capture (the step then
    /// runs eagerly).
    pub pos_dev: Option<&'a Tensor>,
    /// A ragged decode step being captured as a CUDA graph: this layer's caches and each
    /// sequence's position, I64 (sequences, 3) on the device
    /// ([`candle_offload::kernels::attention::ragged_seq_table`]), which the attention reads
    /// instead of the caches' positions on the host, so that each replay runs at the
    /// positions written there. A block that cannot read it fails the capture.
    pub ragged_table: Option<&'a Tensor>,
    /// Where a mixture-of-experts block acquires experts that are units of their own
    /// ([`Layout::experts`]); `None` where the model has none.
    pub experts: Option<&'a dyn crate::layers::ExpertUnits>,
}

impl std::fmt::Debug for StepCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepCtx")
            .field("index_pos", &self.index_pos)
            .field("rope", self.rope)
            .field("masks", self.masks)
            .field("fused", &self.fused)
            .field("pos_dev", &self.pos_dev)
            .field("ragged_table", &self.ragged_table)
            .field("experts", &self.experts.is_some())
            .finish()
    }
}

/// One sequence of a ragged step ([`DecoderBlock::forward_ragged`]): its new positions, which
/// follow the previous sequence's rows, and where they start in its own KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaggedSegment {
    /// New positions (rows of the step).
    pub len: usize,
    /// Positions already in this sequence's cache.
    pub index_pos: usize,
}

/// What a training pass gives every block: a whole sequence from position 0.
pub struct TrainCtx<'a> {
    /// RoPE tables on the training device.
    pub rope: &'a Rope,
    /// Masks for the sequence: `masks.get(window)`.
    pub masks: &'a Masks,
    /// The dtype attention and MLP compute in (autocast); norms and the residual stream stay in
    /// the input's dtype.
    pub compute: DType,
    /// Attention head groups, each checkpointed (1: all heads at once).
    pub head_chunks: usize,
    /// Use the fused training ops of `candle_offload::kernels` (RMSNorm, SwiGLU) and
    /// `kernels::attention::flash_attention` where a block can; `false`: the Candle compositions.
    pub fused: bool,
    /// With `fused`: where a block that computes its own backward pass (the plain pre-norm
    /// block, [`crate::layers::PreNormBlock`]) hands its weights' gradients; `None`: every
    /// block goes through Candle's graph.
    pub weight_grads: Option<WeightGradSink>,
    /// The base weights are frozen (LoRA): a block that computes its own backward pass hands
    /// over only its adapters' gradients.
    pub frozen_base: bool,
}

impl std::fmt::Debug for TrainCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainCtx")
            .field("rope", self.rope)
            .field("masks", self.masks)
            .field("compute", &self.compute)
            .field("head_chunks", &self.head_chunks)
            .field("fused", &self.fused)
            .field("weight_grads", &self.weight_grads.is_some())
            .field("frozen_base", &self.frozen_base)
            .finish()
    }
}

/// Receives the gradient of a weight as a block's forward pass was served it (the tensor is
/// the key; the gradient in any float dtype), from a backward pass computed by hand.
pub type WeightGradSink = Arc<dyn Fn(&Tensor, Tensor) -> Result<()> + Send + Sync>;

/// What a block is built from: the acquired unit's dense tensors as a `VarBuilder`, and its
/// quantized tensors (GGML blocks), which [`linear`](Self::linear) turns into quantized
/// matmuls. Navigate with [`pp`](Self::pp) as with a `VarBuilder`.
#[derive(Clone)]
pub struct UnitWeights<'a> {
    vb: VarBuilder<'static>,
    unit: Option<&'a UnitGuard>,
    adapters: Option<Arc<crate::lora::Adapters>>,
}

impl std::fmt::Debug for UnitWeights<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitWeights")
            .field("prefix", &self.vb.prefix())
            .field(
                "quantized",
                &self.unit.map_or(0, |u| u.quantized_tensors().len()),
            )
            .finish()
    }
}

impl<'a> UnitWeights<'a> {
    /// Dense tensors from `vb`, and quantized ones from `unit` (the guard `vb` came from).
    pub fn new(vb: VarBuilder<'static>, unit: Option<&'a UnitGuard>) -> Self {
        Self {
            vb,
            unit,
            adapters: None,
        }
    }

    /// Only dense tensors, from any `VarBuilder` (training's masters, an application's own).
    pub fn dense(vb: VarBuilder<'static>) -> Self {
        Self {
            vb,
            unit: None,
            adapters: None,
        }
    }

    /// The same weights with LoRA `adapters`: [`linear`](Self::linear) gives a layer whose
    /// module path has one its adapter.
    pub fn with_adapters(mut self, adapters: Option<Arc<crate::lora::Adapters>>) -> Self {
        self.adapters = adapters;
        self
    }

    /// The same weights under `prefix.s`.
    pub fn pp<S: ToString>(&self, s: S) -> Self {
        Self {
            vb: self.vb.pp(s),
            unit: self.unit,
            adapters: self.adapters.clone(),
        }
    }

    /// The dense view (norms, embeddings, an application's own layers).
    pub fn vb(&self) -> &VarBuilder<'static> {
        &self.vb
    }

    /// The tensor `name` under this prefix as GGML blocks, when the unit holds it quantized
    /// (`None`: it is dense, read it from [`vb`](Self::vb)), checked to have `shape`.
    pub fn quantized(&self, name: &str, shape: &[usize]) -> Result<Option<Arc<QTensor>>> {
        let full = match self.vb.prefix() {
            p if p.is_empty() => name.to_string(),
            p => format!("{p}.{name}"),
        };
        let Some(unit) = self
            .unit
            .filter(|u| u.quantized_tensors().contains_key(&full))
        else {
            return Ok(None);
        };
        let q = unit.get_quantized(&full)?;
        if q.shape().dims() != shape {
            candle_core::bail!(
                "{full}: quantized weight has shape {:?}, expected {shape:?}",
                q.shape().dims()
            );
        }
        Ok(Some(q))
    }

    /// Whether the tensor `name` under this prefix is in these weights (dense or blocks).
    pub fn contains(&self, name: &str) -> bool {
        let full = match self.vb.prefix() {
            p if p.is_empty() => name.to_string(),
            p => format!("{p}.{name}"),
        };
        self.unit
            .is_some_and(|u| u.quantized_tensors().contains_key(&full))
            || self.vb.contains_tensor(name)
    }

    /// The linear layer at this prefix (`weight` of shape (out, in), and `bias` when `bias`):
    /// a quantized matmul over the blocks when the unit holds the weight quantized, dense
    /// otherwise; with the LoRA adapter of this module path where the weights carry one
    /// ([`with_adapters`](Self::with_adapters)).
    pub fn linear(&self, in_dim: usize, out_dim: usize, bias: bool) -> Result<Linear> {
        let tuning = self.kernels();
        let l = match self.quantized("weight", &[out_dim, in_dim])? {
            None => crate::layers::linear(in_dim, out_dim, bias, self.vb.clone(), tuning)?,
            Some(q) => {
                let bias = if bias {
                    Some(self.vb.get(out_dim, "bias")?)
                } else {
                    None
                };
                Linear::new(
                    LinearWeight::Quantized(candle_core::quantized::QMatMul::from_arc(q)?),
                    bias,
                    tuning,
                )
            }
        };
        Ok(
            match self
                .adapters
                .as_ref()
                .and_then(|a| a.get(&self.vb.prefix()))
            {
                Some(adapter) => l.with_adapter(adapter.clone()),
                None => l,
            },
        )
    }

    /// The kernel choices of the runtime the unit came from (the defaults for dense weights
    /// without a unit).
    pub fn kernels(&self) -> candle_offload::KernelTuning {
        self.unit.map(|u| u.tuning().kernels).unwrap_or_default()
    }
}

/// The hidden state between decoder layers: whole, or as a sum not yet taken, the last
/// residual add left for the next layer's first kernel (its norm) to do.
#[derive(Debug, Clone)]
pub enum Hidden {
    /// The hidden state itself (batch, seq, hidden).
    Whole(Tensor),
    /// The hidden state is `h + residual` (same shape and dtype).
    Split {
        /// The last sub-layer's output.
        h: Tensor,
        /// The residual stream it is added to.
        residual: Tensor,
    },
}

impl Hidden {
    /// The hidden state, adding a pending sum.
    pub fn into_tensor(self) -> Result<Tensor> {
        match self {
            Self::Whole(t) => Ok(t),
            Self::Split { h, residual } => h + residual,
        }
    }
}

/// One decoder layer, built from its unit right before it runs.
pub trait DecoderBlock: std::fmt::Debug + Send + Sync {
    /// Runs on `xs` (batch, seq, hidden) at positions `ctx.index_pos..`, appending this layer's
    /// keys and values to `kv`.
    fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Tensor>;

    /// As [`forward`](Self::forward) on a [`Hidden`] state, which a block may return split
    /// (its last residual add pending) so that the next block adds it in its first kernel:
    /// one launch less per layer. The default takes the sum and returns the state whole.
    fn forward_hidden(&self, xs: Hidden, ctx: &StepCtx<'_>, kv: &mut KvCache) -> Result<Hidden> {
        Ok(Hidden::Whole(self.forward(&xs.into_tensor()?, ctx, kv)?))
    }

    /// A ragged step: `xs` (1, rows, hidden) holds the new positions of several sequences one
    /// after the other (`segs`), each appending to its own cache in `kvs`; `ctx` gives the
    /// pass's RoPE tables, fused ops and experts (its position and masks are not used: each
    /// sequence has its own). The rows run together through everything but the attention,
    /// which each sequence runs over its cache. Blocks without one refuse batching by
    /// sequence with this error.
    fn forward_ragged(
        &self,
        xs: Hidden,
        ctx: &StepCtx<'_>,
        segs: &[RaggedSegment],
        kvs: &mut [&mut KvCache],
    ) -> Result<Hidden> {
        let _ = (xs, ctx, segs, kvs);
        candle_core::bail!(
            "this model family's blocks cannot run sequences of a batch apart \
             (DecoderBlock::forward_ragged)"
        )
    }

    /// The training pass over whole sequences from position 0, with differentiable ops only.
    /// Families without one refuse training with this error.
    fn forward_train(&self, xs: &Tensor, ctx: &TrainCtx<'_>) -> Result<Tensor> {
        let _ = (xs, ctx);
        candle_core::bail!("this model family has no training path (DecoderBlock::forward_train)")
    }
}

/// Where a family's tensors live: the unit names (tensor-name prefixes) of the embeddings,
/// the decoder layers, the final norm and the output head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The embedding unit (`model.embed_tokens`); its weight is `{embed}.weight`.
    pub embed: String,
    /// Decoder layer `i` is the unit `{layer_prefix}{i}` (`model.layers.`).
    pub layer_prefix: String,
    /// The final norm's unit (`model.norm`).
    pub norm: String,
    /// The output head's unit (`lm_head`), or `None` when it is the embedding matrix (tied).
    pub head: Option<String>,
    /// The experts of mixture-of-experts layers, when each is a unit of its own.
    pub experts: Option<ExpertLayout>,
}

/// Where the experts of a model's mixture-of-experts layers are, each a unit of its own:
/// expert `e` of layer `l` is the unit `{layer_prefix}{l}.{infix}{e}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayout {
    /// The experts' prefix inside a layer (`mlp.experts.`, Mixtral's
    /// `block_sparse_moe.experts.`).
    pub infix: String,
    /// Experts per mixture-of-experts layer.
    pub count: usize,
    /// Per decoder layer, whether it is a mixture-of-experts layer.
    pub sparse: Vec<bool>,
}

impl Layout {
    /// The HF layout of the LLaMA family and most of its relatives.
    pub fn hf(tied: bool) -> Self {
        Self {
            embed: "model.embed_tokens".into(),
            layer_prefix: "model.layers.".into(),
            norm: "model.norm".into(),
            head: (!tied).then(|| "lm_head".into()),
            experts: None,
        }
    }

    /// How a host store groups this layout's tensors into units (one unit per decoder layer
    /// under `layer_prefix`, one per module otherwise).
    pub fn grouping(&self) -> candle_offload::UnitGrouping {
        let g = candle_offload::UnitGrouping::by_prefixes(&[&self.layer_prefix]);
        match &self.experts {
            Some(x) => g.with_experts(&[&x.infix]),
            None => g,
        }
    }

    /// The unit of expert `e` of layer `l` (`None` without [`experts`](Self::experts)).
    pub fn expert(&self, l: usize, e: usize) -> Option<String> {
        let x = self.experts.as_ref()?;
        Some(format!("{}{l}.{}{e}", self.layer_prefix, x.infix))
    }

    /// The expert units of layer `l` (none for a dense layer).
    pub fn experts_of(&self, l: usize) -> Vec<String> {
        match &self.experts {
            Some(x) if x.sparse.get(l).copied().unwrap_or(false) => {
                (0..x.count).filter_map(|e| self.expert(l, e)).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Every unit of layer `l`: the layer's and its experts'.
    pub fn units_of(&self, l: usize) -> Vec<String> {
        let mut out = vec![self.layer(l)];
        out.extend(self.experts_of(l));
        out
    }

    /// The unit of decoder layer `i`.
    pub fn layer(&self, i: usize) -> String {
        format!("{}{i}", self.layer_prefix)
    }

    /// The unit the output head is read from (the embeddings when tied).
    pub fn head_unit(&self) -> &str {
        self.head.as_deref().unwrap_or(&self.embed)
    }

    /// The placement planner's name for a tied head (the embedding matrix kept a second time
    /// on the last stage).
    pub fn tied_head_name(&self) -> String {
        format!("{} (tied output head)", self.embed)
    }

    /// The unit a tensor of this layout belongs to: `model.layers.3.mlp.up_proj.weight` ->
    /// `model.layers.3`, `model.norm.weight` -> `model.norm`.
    pub fn unit_of(&self, tensor: &str) -> String {
        if self.experts.is_some() {
            return self.grouping().unit_of(tensor).0;
        }
        if let Some(rest) = tensor.strip_prefix(&self.layer_prefix) {
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if !digits.is_empty() {
                return format!("{}{digits}", self.layer_prefix);
            }
        }
        tensor
            .rsplit_once('.')
            .map_or(tensor, |(prefix, _)| prefix)
            .to_string()
    }
}

/// A model family: its checkpoint layout and its blocks. See the module docs.
pub trait Family: std::fmt::Debug + Send + Sync + 'static {
    /// The family's name in messages (`llama`, `phi3`, `gemma2`).
    fn name(&self) -> &str;

    /// Every tensor a checkpoint of `cfg` must have, with its shape.
    fn tensors(&self, cfg: &Config) -> Vec<(String, Vec<usize>)>;

    /// The unit names. Default: the HF layout ([`Layout::hf`]).
    fn layout(&self, cfg: &Config) -> Layout {
        Layout::hf(cfg.tie_word_embeddings)
    }

    /// The family fitted to a checkpoint whose tensors are `names`, where the configuration
    /// alone does not say where they are (a multimodal Gemma 3 checkpoint keeps its text model
    /// under `language_model.model.` or `model.language_model.`, by the transformers version
    /// that saved it); `None`: as configured. The loader asks once it knows the names.
    /// Default: `None`.
    fn for_checkpoint(&self, cfg: &Config, names: &[String]) -> Option<Arc<dyn Family>> {
        let _ = (cfg, names);
        None
    }

    /// Checks relations between fields that only this family has; `path` names the config.
    fn validate(&self, cfg: &Config, path: &Path) -> crate::Result<()> {
        let _ = (cfg, path);
        Ok(())
    }

    /// RoPE tables for positions `0..max_len` on `device`. Default: [`Rope::new`].
    fn rope(&self, cfg: &Config, max_len: usize, dtype: DType, device: &Device) -> Result<Rope> {
        Rope::new(cfg, max_len, dtype, device)
    }

    /// Embeds `ids` with the embedding unit's weights (`w` rooted at the checkpoint's top
    /// level; the matrix may be GGML blocks, whose looked-up rows alone are dequantized).
    /// Default: a plain lookup of `{layout.embed}.weight` ([`embed_lookup`]).
    fn embed(&self, cfg: &Config, w: UnitWeights<'_>, ids: &Tensor) -> Result<Tensor> {
        embed_lookup(cfg, &self.layout(cfg).embed, &w, ids)
    }

    /// Decoder layer `layer` from its unit (`w` rooted at the layer's prefix), with the norm
    /// weights in `norm_dtype` and everything else in `w`'s dtype (autocast keeps norms, like
    /// the residual stream, in F32). Projections built with [`UnitWeights::linear`] take
    /// quantized weights as they are.
    fn block(
        &self,
        cfg: &Config,
        w: UnitWeights<'_>,
        layer: usize,
        norm_dtype: DType,
    ) -> Result<Box<dyn DecoderBlock>>;

    /// The final norm from its unit (`vb` rooted at the norm's prefix). Default: RMSNorm.
    fn final_norm(&self, cfg: &Config, vb: VarBuilder, dtype: DType) -> Result<Norm> {
        Norm::load(cfg.hidden_size, cfg.rms_norm_eps, 0.0, vb, dtype)
    }

    /// Applied to the output head's F32 logits (Gemma 2's soft-capping). Default: nothing.
    fn finish_logits(&self, cfg: &Config, logits: Tensor) -> Result<Tensor> {
        let _ = cfg;
        Ok(logits)
    }

    /// Whether [`finish_logits`](Self::finish_logits) changes the logits (so they have to be
    /// F32 first). Default: no.
    fn finishes_logits(&self, cfg: &Config) -> bool {
        let _ = cfg;
        false
    }

    /// Whether every layer's attention is plain causal attention (no sliding window, no
    /// soft-capping), so that a prompt's attention on a GPU runs as one kernel
    /// ([`candle_offload::kernels::attention::prompt_attention`]) in every layer and the reservation may
    /// count on it ([`Config::reserve_bytes_with`]). Default: no (the composition's
    /// reservation, the larger).
    fn plain_attention(&self, cfg: &Config) -> bool {
        let _ = cfg;
        false
    }

    /// The live activations of one layer's MLP for `seq_len` new rows in `dtype`, as the
    /// reservation counts them ([`Config::reserve_bytes_with`]). Default: a dense MLP of
    /// `intermediate_size` (its gate, up, activation and product).
    fn mlp_activation_bytes(&self, cfg: &Config, seq_len: usize, dtype: DType) -> u64 {
        dense_mlp_activation_bytes(seq_len, cfg.intermediate_size, dtype)
    }
}

/// A dense SiLU-gated MLP's live activations for `rows` rows of `width` in `dtype`: its gate,
/// up, activation and product ([`Family::mlp_activation_bytes`]'s default).
pub(crate) fn dense_mlp_activation_bytes(rows: usize, width: usize, dtype: DType) -> u64 {
    4 * (rows * width * dtype.size_in_bytes()) as u64
}

/// A validated decoder configuration: the fields every family shares, the family, and the
/// family's own fields as read.
#[derive(Debug, Clone)]
pub struct Config {
    /// The HF `model_type` (`llama`, `mistral`, `qwen2`, `phi3`, `gemma`, `gemma2`, ...).
    pub model_type: String,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (fewer than query heads: GQA; one: MQA).
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f32,
    /// Llama 3 RoPE scaling, if any.
    pub rope_scaling: Option<Llama3RopeConfig>,
    /// Longest context.
    pub max_position_embeddings: usize,
    /// Whether the output head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections have biases (Qwen2).
    pub attention_bias: bool,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens.
    pub eos_token_ids: Vec<u32>,
    /// The family that builds the model's blocks (looked up by `model_type` when read from
    /// `config.json`; an application's own decoder sets its own).
    pub family: Arc<dyn Family>,
    /// The whole `config.json` object as read (empty for GGUF and hand-made configs): the
    /// family's own fields, kept by [`to_hf_json`](Self::to_hf_json).
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Config {
    /// A configuration for an application's own decoder (`family`): the shapes the runtime
    /// plans with. The rest takes the usual defaults (`head_dim` = hidden / heads, as many KV
    /// heads as query heads, RMSNorm eps 1e-6, RoPE base 10 000 without scaling, 4096
    /// positions, untied head, no biases, no special tokens); set the public fields to change
    /// them, then [`validate`](Self::validate).
    pub fn new(
        family: Arc<dyn Family>,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        vocab_size: usize,
    ) -> Self {
        Self {
            model_type: family.name().to_string(),
            hidden_size,
            intermediate_size,
            vocab_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: num_attention_heads,
            head_dim: hidden_size / num_attention_heads.max(1),
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            attention_bias: false,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            family,
            extra: Default::default(),
        }
    }

    /// Checks the relations between fields.
    pub fn validate(&self, path: &Path) -> crate::Result<()> {
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(crate::ModelError::config(
                path,
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(crate::ModelError::config(
                path,
                "head_dim",
                format!("{} is odd; RoPE needs an even width", self.head_dim),
            ));
        }
        self.family.validate(self, path)
    }

    /// The unit names of this model's family.
    pub fn layout(&self) -> Layout {
        self.family.layout(self)
    }

    /// Every tensor a checkpoint of this configuration must have, with its shape.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        self.family.tensors(self)
    }
}

/// Looks `ids` up in the embedding matrix `{unit}.weight` (vocab, hidden) of `vb`.
pub fn embed_lookup(cfg: &Config, unit: &str, w: &UnitWeights<'_>, ids: &Tensor) -> Result<Tensor> {
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let w = w.pp(unit);
    if let Some(q) = w.quantized("weight", &[vocab, hidden])? {
        return q.embedding(ids)?.to_dtype(w.vb().dtype());
    }
    let m = w.vb().get((vocab, hidden), "weight")?;
    candle_nn::Embedding::new(m, hidden).forward(ids)
}
