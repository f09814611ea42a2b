//! Binary ONNX (`ModelProto`) → the syntax tree the text frontend builds, so that one lowering
//! (name resolution, attribute kinds, typed ops, diagnostics) serves both formats.
//!
//! A binary file has no lines to point at, so every place a diagnostic may point at gets a
//! span that indexes [`Locations`]: the field path inside the protobuf
//! (`graph.node[12].attribute[1]`, with the node's type and name beside it). Tensor values are
//! decoded once into [`TensorData`] and handed to the lowering by index, never turned into text.
//! External data is kept as its reference: nothing here reads the files it names.

use ir::tensor::Storage;
use ir::{AttrKind, DType, Dim, Span, TensorData, TensorType, Type};
use prost::Message;

use super::proto;
use crate::ast::{self, Data, HeaderItem, HeaderValue, LiteralKind, Single, Spanned};
use crate::diag::Diagnostic;

/// Field paths of a binary model: a span of a binary model is an index into this table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Locations {
    paths: Vec<String>,
}

impl Locations {
    fn add(&mut self, path: String) -> Span {
        let i = self.paths.len();
        self.paths.push(path);
        Span::new(i, i + 1)
    }

    /// The field path a span stands for.
    pub fn path(&self, span: Span) -> Option<&str> {
        self.paths.get(span.start as usize).map(String::as_str)
    }

    /// Number of locations.
    pub fn len(&self) -> usize {
        self.paths.len()
    }

    /// True when there is none.
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }
}

/// A binary model read into a syntax tree, with the decoded tensor values the tree refers to
/// ([`Data::Decoded`]) and the locations its spans index.
pub struct Read {
    /// The syntax tree.
    pub ast: ast::Model,
    /// Tensor values, by the index in [`Data::Decoded`].
    pub values: Vec<TensorData>,
    /// Field paths.
    pub locations: Locations,
    /// Things read past (such as training information).
    pub warnings: Vec<Diagnostic>,
}

/// True when `bytes` are a binary model rather than text: the text syntax starts (after
/// whitespace) with a `<` header, a `#` comment or the graph's name (a letter, `_` or a quoted
/// name); a protobuf `ModelProto` starts with a field tag, `0x08` for `ir_version` in every
/// writer's output, which text never does.
pub fn is_binary(bytes: &[u8]) -> bool {
    match bytes.iter().find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r')) {
        None => false,
        Some(&b) => !(b == b'<' || b == b'#' || b == b'_' || b == b'"' || b.is_ascii_alphabetic()),
    }
}

/// Decodes a binary model. On failure, every problem found, located by field path.
pub fn read(bytes: &[u8]) -> Result<Read, (Vec<Diagnostic>, Locations)> {
    let mut r = Reader { values: Vec::new(), locations: Locations::default(), errors: Vec::new() };
    let model = match proto::ModelProto::decode(bytes) {
        Ok(m) => m,
        Err(e) => {
            let span = r.locations.add("(the whole file)".into());
            // prost names the field path of what failed: `ModelProto.graph: GraphProto.node: …`.
            let d = Diagnostic::error(format!("this is not a valid ONNX protobuf: {}", describe_decode_error(&e)))
                .with_primary(span, "")
                .with_note(
                    "shardc reads binary ONNX (ModelProto) and the ONNX text syntax; the file may be truncated or \
                     another format",
                );
            return Err((vec![d], r.locations));
        }
    };
    let Some(graph) = &model.graph else {
        let span = r.locations.add("ModelProto.graph".into());
        let d = Diagnostic::error("the file holds no ONNX graph (ModelProto.graph is missing)")
            .with_primary(span, "no graph")
            .with_note("shardc reads binary ONNX (ModelProto) and the ONNX text syntax");
        return Err((vec![d], r.locations));
    };
    let header = r.header(&model);
    let graph = r.graph(graph, "graph");
    let functions =
        model.functions.iter().enumerate().map(|(i, f)| r.function(f, &format!("functions[{i}]"))).collect();
    if !model.training_info.is_empty() {
        r.warn_dropped(
            "training_info",
            "training information (TrainingInfoProto) is not read; shardc derives training itself",
        );
    }
    if r.errors.iter().any(Diagnostic::is_error) {
        return Err((r.errors, r.locations));
    }
    Ok(Read {
        ast: ast::Model { header: Some(header), graph, functions },
        values: r.values,
        locations: r.locations,
        warnings: r.errors,
    })
}

/// Reads one serialized `TensorProto` (a `.pb` file of ONNX test data): its name and values.
/// External data is refused (such a file holds no values).
pub fn read_tensor(bytes: &[u8]) -> Result<ir::Tensor, String> {
    let t =
        proto::TensorProto::decode(bytes).map_err(|e| format!("not a TensorProto: {}", describe_decode_error(&e)))?;
    let dtype = match DType::from_code(i64::from(t.data_type.unwrap_or(0))) {
        Some(d) => d,
        None => return Err(format!("unknown element type code {}", t.data_type.unwrap_or(0))),
    };
    if t.data_location == Some(proto::tensor_proto::DataLocation::External as i32) {
        return Err("the tensor's data is external".into());
    }
    let data = Reader::tensor_data(&t, dtype)?;
    let tensor = ir::Tensor { dtype, dims: t.dims.clone(), name: t.name.clone().filter(|n| !n.is_empty()), data };
    if let Some(len) = tensor.stored_len()
        && len as u64 != tensor.numel() * tensor.values_per_element()
    {
        return Err(format!("{} needs {} value(s), found {len}", tensor.tensor_type(), tensor.numel()));
    }
    Ok(tensor)
}

/// prost's message, which lists the failing field path outermost first.
fn describe_decode_error(e: &prost::DecodeError) -> String {
    let s = e.to_string();
    s.strip_prefix("failed to decode Protobuf message: ").unwrap_or(&s).to_string()
}

struct Reader {
    values: Vec<TensorData>,
    locations: Locations,
    errors: Vec<Diagnostic>,
}

fn spanned<T>(node: T, span: Span) -> Spanned<T> {
    Spanned { node, span }
}

impl Reader {
    fn loc(&mut self, path: impl Into<String>) -> Span {
        self.locations.add(path.into())
    }

    fn error(&mut self, path: &str, message: impl Into<String>, label: impl Into<String>) {
        let span = self.loc(path.to_string());
        self.errors.push(Diagnostic::error(message).with_primary(span, label));
    }

    fn warn_dropped(&mut self, path: &str, message: &str) {
        let span = self.loc(path.to_string());
        self.errors.push(Diagnostic::warning(message.to_string()).with_primary(span, "ignored"));
    }

    fn lit(&mut self, kind: LiteralKind, path: &str) -> ast::Literal {
        let span = self.loc(path.to_string());
        spanned(kind, span)
    }

    fn header(&mut self, m: &proto::ModelProto) -> Vec<HeaderItem> {
        let mut items = Vec::new();
        let mut item = |r: &mut Reader, key: &str, value: HeaderValue| {
            let span = r.loc(format!("ModelProto.{key}"));
            items.push(HeaderItem { key: spanned(key.to_string(), span), value, span });
        };
        let int = |r: &mut Reader, key: &str, v: i64| HeaderValue::Literal(r.lit(LiteralKind::Int(v.to_string()), key));
        let string = |r: &mut Reader, key: &str, v: &str| HeaderValue::Literal(r.lit(LiteralKind::Str(v.into()), key));
        let v = int(self, "ir_version", m.ir_version.unwrap_or(0));
        item(self, "ir_version", v);
        let pairs = self.opsets(&m.opset_import, "ModelProto.opset_import");
        item(self, "opset_import", pairs);
        for (key, val) in
            [("producer_name", &m.producer_name), ("producer_version", &m.producer_version), ("domain", &m.domain)]
        {
            if let Some(s) = val {
                let v = string(self, key, s);
                item(self, key, v);
            }
        }
        if let Some(v) = m.model_version {
            let v = int(self, "model_version", v);
            item(self, "model_version", v);
        }
        if let Some(s) = &m.doc_string {
            let v = string(self, "doc_string", s);
            item(self, "doc_string", v);
        }
        if !m.metadata_props.is_empty() {
            let span = self.loc("ModelProto.metadata_props");
            let pairs = m
                .metadata_props
                .iter()
                .map(|p| {
                    (
                        spanned(p.key.clone().unwrap_or_default(), span),
                        spanned(LiteralKind::Str(p.value.clone().unwrap_or_default()), span),
                    )
                })
                .collect();
            item(self, "metadata_props", HeaderValue::Pairs(pairs, span));
        }
        items
    }

    fn opsets(&mut self, opsets: &[proto::OperatorSetIdProto], path: &str) -> HeaderValue {
        let span = self.loc(path.to_string());
        let pairs = opsets
            .iter()
            .map(|o| {
                (
                    spanned(o.domain.clone().unwrap_or_default(), span),
                    spanned(LiteralKind::Int(o.version.unwrap_or(0).to_string()), span),
                )
            })
            .collect();
        HeaderValue::Pairs(pairs, span)
    }

    fn dtype(&mut self, code: i32, path: &str) -> Option<DType> {
        match DType::from_code(i64::from(code)) {
            Some(d) => Some(d),
            None => {
                let why = if code == 0 {
                    "the element type is missing (UNDEFINED)".to_string()
                } else {
                    format!("unknown element type code {code}")
                };
                self.error(path, format!("{why} at {path}"), "element type");
                None
            }
        }
    }

    fn shape(shape: &proto::TensorShapeProto) -> Vec<Dim> {
        use proto::tensor_shape_proto::dimension::Value;
        shape
            .dim
            .iter()
            .map(|d| match &d.value {
                Some(Value::DimValue(v)) => Dim::Fixed(*v),
                Some(Value::DimParam(s)) if !s.is_empty() => Dim::Sym(s.clone()),
                _ => Dim::Unknown,
            })
            .collect()
    }

    fn ty(&mut self, t: &proto::TypeProto, path: &str) -> Option<Type> {
        use proto::type_proto::Value;
        Some(match t.value.as_ref()? {
            Value::TensorType(tt) => {
                let dtype = self.dtype(tt.elem_type.unwrap_or(0), &format!("{path}.tensor_type.elem_type"))?;
                Type::Tensor(TensorType { dtype, dims: tt.shape.as_ref().map(Self::shape) })
            }
            Value::SparseTensorType(tt) => {
                let dtype = self.dtype(tt.elem_type.unwrap_or(0), &format!("{path}.sparse_tensor_type.elem_type"))?;
                Type::SparseTensor(TensorType { dtype, dims: tt.shape.as_ref().map(Self::shape) })
            }
            Value::SequenceType(s) => {
                let inner = s.elem_type.as_deref()?;
                Type::Seq(Box::new(self.ty(inner, &format!("{path}.sequence_type.elem_type"))?))
            }
            Value::OptionalType(s) => {
                let inner = s.elem_type.as_deref()?;
                Type::Optional(Box::new(self.ty(inner, &format!("{path}.optional_type.elem_type"))?))
            }
            Value::MapType(m) => {
                let key = self.dtype(m.key_type.unwrap_or(0), &format!("{path}.map_type.key_type"))?;
                let inner = m.value_type.as_deref()?;
                Type::Map(key, Box::new(self.ty(inner, &format!("{path}.map_type.value_type"))?))
            }
            Value::OpaqueType(o) => {
                Type::Opaque { domain: o.domain.clone().unwrap_or_default(), name: o.name.clone().unwrap_or_default() }
            }
        })
    }

    fn value_info(&mut self, v: &proto::ValueInfoProto, path: &str) -> ast::ValueInfo {
        let name = v.name.clone().unwrap_or_default();
        let span = self.loc(format!("{path} (`{name}`)"));
        let ty = v.r#type.as_ref().and_then(|t| self.ty(t, path)).map(|ty| ast::TypeAst { ty, span });
        ast::ValueInfo { ty, name: spanned(name, span) }
    }

    /// A tensor's type and data; `None` after reporting why it cannot be read.
    fn tensor(&mut self, t: &proto::TensorProto, path: &str) -> Option<(ast::TypeAst, Data)> {
        let span = self.loc(match &t.name {
            Some(n) if !n.is_empty() => format!("{path} (`{n}`)"),
            _ => path.to_string(),
        });
        let dtype = self.dtype(t.data_type.unwrap_or(0), &format!("{path}.data_type"))?;
        if t.segment.is_some() {
            self.error(path, format!("segmented tensors are not supported ({path}.segment)"), "segment");
            return None;
        }
        let ty = ast::TypeAst {
            ty: Type::Tensor(TensorType::new(dtype, t.dims.iter().map(|&d| Dim::Fixed(d)).collect())),
            span,
        };
        if t.data_location == Some(proto::tensor_proto::DataLocation::External as i32) {
            let entries = t
                .external_data
                .iter()
                .map(|e| (e.key.clone().unwrap_or_default(), e.value.clone().unwrap_or_default()))
                .collect();
            return Some((ty, Data::External(entries, span)));
        }
        let data = match Self::tensor_data(t, dtype) {
            Ok(d) => d,
            Err(msg) => {
                self.errors.push(Diagnostic::error(format!("{msg} ({path})")).with_primary(span, "this tensor"));
                return None;
            }
        };
        self.values.push(data);
        Some((ty, Data::Decoded(self.values.len() - 1, span)))
    }

    fn tensor_data(t: &proto::TensorProto, dtype: DType) -> Result<TensorData, String> {
        let Some(storage) = Storage::of(dtype) else {
            return Err(format!("{dtype} tensors (packed 2-bit values) are not supported"));
        };
        let packed = matches!(dtype, DType::Int4 | DType::Uint4 | DType::Float4e2m1);
        let numel = t.dims.iter().try_fold(1usize, |a, &d| a.checked_mul(usize::try_from(d).ok()?)).unwrap_or(0);
        if let Some(raw) = &t.raw_data {
            if packed {
                return Ok(unpack4(raw.iter().map(|&b| i32::from(b)), dtype, numel));
            }
            return raw_values(raw, dtype, storage);
        }
        if packed {
            // Two 4-bit values to a byte (the low nibble first), a byte to each int32_data entry.
            return Ok(unpack4(t.int32_data.iter().copied(), dtype, numel));
        }
        let fields = [
            ("float_data", !t.float_data.is_empty()),
            ("int32_data", !t.int32_data.is_empty()),
            ("string_data", !t.string_data.is_empty()),
            ("int64_data", !t.int64_data.is_empty()),
            ("double_data", !t.double_data.is_empty()),
            ("uint64_data", !t.uint64_data.is_empty()),
        ];
        let used: Vec<&str> = fields.iter().filter(|(_, u)| *u).map(|(n, _)| *n).collect();
        let want = match storage {
            Storage::Int32 => "int32_data",
            Storage::Int64 => "int64_data",
            Storage::Uint64 => "uint64_data",
            Storage::Float => "float_data",
            Storage::Double => "double_data",
            Storage::Strings => "string_data",
        };
        if let Some(other) = used.iter().find(|f| **f != want) {
            return Err(format!("a {dtype} tensor holds its values in `{other}`; ONNX keeps {dtype} in `{want}`"));
        }
        Ok(match storage {
            Storage::Int32 => TensorData::Int32(t.int32_data.clone()),
            Storage::Int64 => TensorData::Int64(t.int64_data.clone()),
            Storage::Uint64 => TensorData::Uint64(t.uint64_data.clone()),
            Storage::Float => TensorData::Float(t.float_data.clone()),
            Storage::Double => TensorData::Double(t.double_data.clone()),
            Storage::Strings => {
                TensorData::Strings(t.string_data.iter().map(|s| String::from_utf8_lossy(s).into_owned()).collect())
            }
        })
    }

    fn graph(&mut self, g: &proto::GraphProto, path: &str) -> ast::Graph {
        let name = g.name.clone().unwrap_or_default();
        let span = self.loc(format!("{path} (`{name}`)"));
        if !g.sparse_initializer.is_empty() {
            self.error(
                &format!("{path}.sparse_initializer"),
                format!(
                    "sparse initializers are not supported ({path}.sparse_initializer, {} of them)",
                    g.sparse_initializer.len()
                ),
                "sparse initializer",
            );
        }
        let inputs = g
            .input
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let info = self.value_info(v, &format!("{path}.input[{i}]"));
                let span = info.name.span;
                ast::Entry { info, data: None, span }
            })
            .collect();
        let outputs =
            g.output.iter().enumerate().map(|(i, v)| self.value_info(v, &format!("{path}.output[{i}]"))).collect();
        let mut inits = Vec::new();
        for (i, t) in g.initializer.iter().enumerate() {
            let p = format!("{path}.initializer[{i}]");
            let name = t.name.clone().unwrap_or_default();
            let Some((ty, data)) = self.tensor(t, &p) else { continue };
            let span = ty.span;
            inits.push(ast::Entry {
                info: ast::ValueInfo { ty: Some(ty), name: spanned(name, span) },
                data: Some(data),
                span,
            });
        }
        for (i, v) in g.value_info.iter().enumerate() {
            let info = self.value_info(v, &format!("{path}.value_info[{i}]"));
            let span = info.name.span;
            inits.push(ast::Entry { info, data: None, span });
        }
        let nodes = g.node.iter().enumerate().map(|(i, n)| self.node(n, &format!("{path}.node[{i}]"))).collect();
        ast::Graph { name: spanned(name, span), inputs, outputs, inits, nodes, span }
    }

    fn node(&mut self, n: &proto::NodeProto, path: &str) -> ast::Node {
        let op_type = n.op_type.clone().unwrap_or_default();
        let label = n.name.clone().filter(|s| !s.is_empty());
        let what = match &label {
            Some(l) => format!("{path} ({op_type} `{l}`)"),
            None => format!("{path} ({op_type})"),
        };
        let span = self.loc(what.clone());
        let names = |r: &mut Reader, list: &[String], field: &str| -> Vec<Option<Spanned<String>>> {
            list.iter()
                .enumerate()
                .map(|(i, s)| {
                    if s.is_empty() {
                        None
                    } else {
                        let span = r.loc(format!("{what}.{field}[{i}] (`{s}`)"));
                        Some(spanned(s.clone(), span))
                    }
                })
                .collect()
        };
        let outputs = names(self, &n.output, "output");
        let inputs = names(self, &n.input, "input");
        let mut attrs: Vec<ast::Attr> = n
            .attribute
            .iter()
            .enumerate()
            .filter_map(|(i, a)| self.attr(a, &format!("{what}.attribute[{i}]")))
            .collect();
        if let Some(module) = self.module_of(n, &what) {
            attrs.push(module);
        }
        let domain = n.domain.clone().unwrap_or_default();
        let op_span = self.loc(format!("{what}.op_type"));
        ast::Node {
            label: label.map(|l| spanned(l, span)),
            outputs,
            domain,
            op_type: spanned(op_type, op_span),
            overload: n.overload.clone().filter(|s| !s.is_empty()),
            attrs,
            inputs,
            span,
        }
    }

    /// The module the exporter says node `n` came from (torch's dynamo exporter writes it in
    /// the node's metadata), as the annotation attribute the text syntax writes for it.
    fn module_of(&mut self, n: &proto::NodeProto, what: &str) -> Option<ast::Attr> {
        let prop = |key: &str| {
            n.metadata_props.iter().find(|p| p.key.as_deref() == Some(key)).and_then(|p| p.value.as_deref())
        };
        if n.attribute.iter().any(|a| a.name.as_deref() == Some(ir::scope::MODULE)) {
            return None;
        }
        let text = match prop(ir::scope::MODULE) {
            Some(t) => t.to_string(),
            None => ir::scope::torch_module_annotation(
                prop("pkg.torch.onnx.name_scopes")?,
                prop("pkg.torch.onnx.class_hierarchy"),
            )?,
        };
        let path = format!("{what}.metadata_props");
        let span = self.loc(path.clone());
        let value = ast::AttrValue::Single(Single::Literal(self.lit(LiteralKind::Str(text), &path)));
        Some(ast::Attr {
            name: spanned(ir::scope::MODULE.to_string(), span),
            kind: Some(spanned(AttrKind::String.name().to_string(), span)),
            value,
            span,
        })
    }

    fn attr(&mut self, a: &proto::AttributeProto, path: &str) -> Option<ast::Attr> {
        use proto::attribute_proto::AttributeType as T;
        let name = a.name.clone().unwrap_or_default();
        let path = format!("{path} (`{name}`)");
        let span = self.loc(path.clone());
        let declared = a.r#type.and_then(|t| T::try_from(t).ok()).unwrap_or(T::Undefined);
        let ty = if declared == T::Undefined { infer_attr_type(a) } else { declared };
        let kind = match ty {
            T::Float => AttrKind::Float,
            T::Int => AttrKind::Int,
            T::String => AttrKind::String,
            T::Tensor => AttrKind::Tensor,
            T::Graph => AttrKind::Graph,
            T::TypeProto => AttrKind::TypeProto,
            T::Floats => AttrKind::Floats,
            T::Ints => AttrKind::Ints,
            T::Strings => AttrKind::Strings,
            T::Tensors => AttrKind::Tensors,
            T::Graphs => AttrKind::Graphs,
            T::TypeProtos => AttrKind::TypeProtos,
            T::SparseTensor | T::SparseTensors => {
                self.errors.push(
                    Diagnostic::error(format!("sparse tensor attributes are not supported (`{name}` at {path})"))
                        .with_primary(span, "sparse tensor"),
                );
                return None;
            }
            T::Undefined => {
                self.errors.push(
                    Diagnostic::error(format!("attribute `{name}` has no value ({path})"))
                        .with_primary(span, "empty attribute"),
                );
                return None;
            }
        };
        let kind_name = spanned(kind.name().to_string(), span);
        if let Some(r) = a.ref_attr_name.as_ref().filter(|r| !r.is_empty()) {
            let value = ast::AttrValue::Single(Single::Ref(spanned(r.clone(), span)));
            return Some(ast::Attr { name: spanned(name, span), kind: Some(kind_name), value, span });
        }
        let lit = |r: &mut Reader, k: LiteralKind| Single::Literal(r.lit(k, &path));
        let string = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let value = match ty {
            T::Float => ast::AttrValue::Single(lit(self, float_literal(a.f.unwrap_or(0.0)))),
            T::Int => ast::AttrValue::Single(lit(self, LiteralKind::Int(a.i.unwrap_or(0).to_string()))),
            T::String => {
                ast::AttrValue::Single(lit(self, LiteralKind::Str(string(a.s.as_deref().unwrap_or_default()))))
            }
            T::Tensor => {
                let t = a.t.as_ref()?;
                ast::AttrValue::Single(self.tensor_single(t, &format!("{path}.t"))?)
            }
            T::Graph => {
                let g = a.g.as_ref()?;
                ast::AttrValue::Single(Single::Graph(Box::new(self.graph(g, &format!("{path}.g")))))
            }
            T::TypeProto => {
                let t = a.tp.as_ref()?;
                let ty = self.ty(t, &format!("{path}.tp"))?;
                ast::AttrValue::Single(Single::Type(ast::TypeAst { ty, span }))
            }
            T::Floats => ast::AttrValue::List(a.floats.iter().map(|&f| lit(self, float_literal(f))).collect(), span),
            T::Ints => {
                ast::AttrValue::List(a.ints.iter().map(|&i| lit(self, LiteralKind::Int(i.to_string()))).collect(), span)
            }
            T::Strings => {
                ast::AttrValue::List(a.strings.iter().map(|s| lit(self, LiteralKind::Str(string(s)))).collect(), span)
            }
            T::Tensors => {
                let mut items = Vec::new();
                for (i, t) in a.tensors.iter().enumerate() {
                    items.push(self.tensor_single(t, &format!("{path}.tensors[{i}]"))?);
                }
                ast::AttrValue::List(items, span)
            }
            T::Graphs => ast::AttrValue::List(
                a.graphs
                    .iter()
                    .enumerate()
                    .map(|(i, g)| Single::Graph(Box::new(self.graph(g, &format!("{path}.graphs[{i}]")))))
                    .collect(),
                span,
            ),
            T::TypeProtos => {
                let mut items = Vec::new();
                for (i, t) in a.type_protos.iter().enumerate() {
                    let ty = self.ty(t, &format!("{path}.type_protos[{i}]"))?;
                    items.push(Single::Type(ast::TypeAst { ty, span }));
                }
                ast::AttrValue::List(items, span)
            }
            T::SparseTensor | T::SparseTensors | T::Undefined => unreachable!("handled above"),
        };
        Some(ast::Attr { name: spanned(name, span), kind: Some(kind_name), value, span })
    }

    fn tensor_single(&mut self, t: &proto::TensorProto, path: &str) -> Option<Single> {
        let (ty, data) = self.tensor(t, path)?;
        let span = ty.span;
        Some(Single::Tensor { ty, name: t.name.clone().filter(|n| !n.is_empty()), data, span })
    }

    fn function(&mut self, f: &proto::FunctionProto, path: &str) -> ast::Function {
        let name = f.name.clone().unwrap_or_default();
        let span = self.loc(format!("{path} (`{name}`)"));
        let mut header = Vec::new();
        let mut item = |key: &str, value: HeaderValue| {
            header.push(HeaderItem { key: spanned(key.to_string(), span), value, span });
        };
        item("domain", HeaderValue::Literal(spanned(LiteralKind::Str(f.domain.clone().unwrap_or_default()), span)));
        if let Some(o) = f.overload.as_ref().filter(|o| !o.is_empty()) {
            item("overload", HeaderValue::Literal(spanned(LiteralKind::Str(o.clone()), span)));
        }
        let opsets = self.opsets(&f.opset_import, &format!("{path}.opset_import"));
        header.push(HeaderItem { key: spanned("opset_import".into(), span), value: opsets, span });
        let names = |r: &mut Reader, list: &[String], field: &str| -> Vec<ast::ValueInfo> {
            list.iter()
                .enumerate()
                .map(|(i, s)| {
                    let span = r.loc(format!("{path}.{field}[{i}] (`{s}`)"));
                    ast::ValueInfo { ty: None, name: spanned(s.clone(), span) }
                })
                .collect()
        };
        let inputs = names(self, &f.input, "input");
        let outputs = names(self, &f.output, "output");
        let attr_params = f.attribute.iter().map(|a| spanned(a.clone(), span)).collect();
        let attr_defaults = f
            .attribute_proto
            .iter()
            .enumerate()
            .filter_map(|(i, a)| self.attr(a, &format!("{path}.attribute_proto[{i}]")))
            .collect();
        let value_infos = f
            .value_info
            .iter()
            .enumerate()
            .map(|(i, v)| self.value_info(v, &format!("{path}.value_info[{i}]")))
            .collect();
        let nodes = f.node.iter().enumerate().map(|(i, n)| self.node(n, &format!("{path}.node[{i}]"))).collect();
        ast::Function {
            header: Some(header),
            name: spanned(name, span),
            attr_params,
            attr_defaults,
            inputs,
            outputs,
            value_infos,
            nodes,
            span,
        }
    }
}

/// The kind of an attribute written before IR version 2 (no `type`): the field that is set.
fn infer_attr_type(a: &proto::AttributeProto) -> proto::attribute_proto::AttributeType {
    use proto::attribute_proto::AttributeType as T;
    if a.f.is_some() {
        T::Float
    } else if a.i.is_some() {
        T::Int
    } else if a.s.is_some() {
        T::String
    } else if a.t.is_some() {
        T::Tensor
    } else if a.g.is_some() {
        T::Graph
    } else if a.tp.is_some() {
        T::TypeProto
    } else if !a.floats.is_empty() {
        T::Floats
    } else if !a.ints.is_empty() {
        T::Ints
    } else if !a.strings.is_empty() {
        T::Strings
    } else if !a.tensors.is_empty() {
        T::Tensors
    } else if !a.graphs.is_empty() {
        T::Graphs
    } else if !a.type_protos.is_empty() {
        T::TypeProtos
    } else if a.sparse_tensor.is_some() || !a.sparse_tensors.is_empty() {
        T::SparseTensor
    } else {
        T::Undefined
    }
}

/// 4-bit values packed two to a byte (the first in the low nibble), one per element, signed
/// for int4.
fn unpack4(bytes: impl ExactSizeIterator<Item = i32>, dtype: DType, numel: usize) -> TensorData {
    // What the bytes hold, at most: dims claim any count (a 2^40-element tensor of no bytes).
    let mut out = Vec::with_capacity(numel.min(bytes.len().saturating_mul(2)));
    for b in bytes {
        for nib in [b & 0xf, (b >> 4) & 0xf] {
            if out.len() < numel {
                out.push(if dtype == DType::Int4 && nib >= 8 { nib - 16 } else { nib });
            }
        }
    }
    TensorData::Int32(out)
}

/// A float as a literal that parses back to the same `f32` (Rust prints the shortest such).
fn float_literal(f: f32) -> LiteralKind {
    LiteralKind::Float(if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf".into() } else { "-inf".into() }
    } else {
        format!("{f:?}")
    })
}

/// Little-endian bytes (`raw_data`, or a slice of an external data file) as the values of a
/// `dtype` tensor.
pub fn raw_tensor_data(raw: &[u8], dtype: DType) -> Result<TensorData, String> {
    let Some(storage) = Storage::of(dtype) else {
        return Err(format!("{dtype} tensors (packed 2-bit values) are not supported"));
    };
    if matches!(dtype, DType::Int4 | DType::Uint4 | DType::Float4e2m1) {
        return Err(format!("{dtype} tensors stored as packed bytes are not supported"));
    }
    raw_values(raw, dtype, storage)
}

/// Little-endian `raw_data` as the values of `storage`.
fn raw_values(raw: &[u8], dtype: DType, storage: Storage) -> Result<TensorData, String> {
    let width = (dtype.bits() / 8) as usize;
    if storage == Storage::Strings {
        return Err("a string tensor cannot hold raw_data".into());
    }
    if width == 0 || !raw.len().is_multiple_of(width) {
        return Err(format!("raw_data of {} bytes is not a whole number of {dtype} values", raw.len()));
    }
    fn chunks<const N: usize, T>(raw: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        raw.chunks_exact(N).map(|c| f(c.try_into().expect("exact chunk"))).collect()
    }
    use DType::*;
    Ok(match (storage, dtype) {
        (Storage::Float, _) => TensorData::Float(chunks(raw, f32::from_le_bytes)),
        (Storage::Double, _) => TensorData::Double(chunks(raw, f64::from_le_bytes)),
        (Storage::Int64, _) => TensorData::Int64(chunks(raw, i64::from_le_bytes)),
        (Storage::Uint64, Uint32) => TensorData::Uint64(chunks(raw, |b| u64::from(u32::from_le_bytes(b)))),
        (Storage::Uint64, _) => TensorData::Uint64(chunks(raw, u64::from_le_bytes)),
        (Storage::Int32, Int32) => TensorData::Int32(chunks(raw, i32::from_le_bytes)),
        (Storage::Int32, Int16) => TensorData::Int32(chunks(raw, |b| i32::from(i16::from_le_bytes(b)))),
        (Storage::Int32, Uint16 | Float16 | Bfloat16) => {
            TensorData::Int32(chunks(raw, |b| i32::from(u16::from_le_bytes(b))))
        }
        (Storage::Int32, Int8) => TensorData::Int32(raw.iter().map(|&b| i32::from(b as i8)).collect()),
        (Storage::Int32, _) => TensorData::Int32(raw.iter().map(|&b| i32::from(b)).collect()),
        (Storage::Strings, _) => unreachable!("refused above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_binary_by_content() {
        assert!(is_binary(&[0x08, 0x08, 0x12, 0x03]));
        assert!(!is_binary(b"  <ir_version: 8>\ng () => () {}"));
        assert!(!is_binary(b"# a comment\ng (float x) => (float y) { y = Relu(x) }"));
        assert!(is_binary(&[0xff, 0xfe]));
        assert!(!is_binary(b""));
        // Text with a byte that is not UTF-8 stays text (the text frontend says where).
        assert!(!is_binary(b"<ir_version: 8>\n# caf\xe9\n"));
    }

    #[test]
    fn raw_values_decode_little_endian() {
        let raw: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        assert_eq!(raw_values(&raw, DType::Float, Storage::Float).unwrap(), TensorData::Float(vec![1.5, -2.0]));
        assert_eq!(raw_values(&[0xff, 1], DType::Int8, Storage::Int32).unwrap(), TensorData::Int32(vec![-1, 1]));
        assert_eq!(raw_values(&[0x00, 0x3c], DType::Float16, Storage::Int32).unwrap(), TensorData::Int32(vec![0x3c00]));
        assert!(raw_values(&[0, 0, 0], DType::Float, Storage::Float).is_err());
    }

    #[test]
    fn float_literals_round_trip() {
        for f in [0.1f32, 1e-45, f32::MAX, -0.0, 3.0, 1.0e10] {
            let LiteralKind::Float(s) = float_literal(f) else { panic!() };
            assert_eq!(s.parse::<f32>().unwrap().to_bits(), f.to_bits(), "{s}");
        }
    }
}
