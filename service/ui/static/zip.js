// A zip of several files, stored without compression: how the dashboard uploads a model with its
// external data files as the one zip POST /v1/models accepts. window.opfuseZip(files) -> Promise<Blob>.
"use strict";
(function () {
  var table = new Uint32Array(256);
  for (var n = 0; n < 256; n++) {
    var c = n;
    for (var k = 0; k < 8; k++) { c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1; }
    table[n] = c >>> 0;
  }

  function crc32(bytes) {
    var crc = 0xffffffff;
    for (var i = 0; i < bytes.length; i++) { crc = table[(crc ^ bytes[i]) & 0xff] ^ (crc >>> 8); }
    return (crc ^ 0xffffffff) >>> 0;
  }

  function header(size, fields) {
    var buf = new ArrayBuffer(size), view = new DataView(buf);
    fields.forEach(function (f) { (f[2] === 4 ? view.setUint32 : view.setUint16).call(view, f[0], f[1], true); });
    return new Uint8Array(buf);
  }

  // Only plain file names go into the zip: the server refuses paths that escape it anyway.
  function entryName(file) {
    var name = file.name.split("/").pop().split("\\").pop();
    return new TextEncoder().encode(name);
  }

  async function zip(files) {
    var parts = [], central = [], offset = 0;
    for (var i = 0; i < files.length; i++) {
      var data = new Uint8Array(await files[i].arrayBuffer()), name = entryName(files[i]);
      if (data.length >= 0xffffffff || offset >= 0xffffffff) {
        throw new Error("a file over 4 GiB cannot be packed here; zip the model with its data yourself");
      }
      var crc = crc32(data);
      // local file header: signature, version 2.0, UTF-8 names, stored, crc, sizes, name length
      var local = header(30, [[0, 0x04034b50, 4], [4, 20], [6, 0x0800], [8, 0], [14, crc, 4],
        [18, data.length, 4], [22, data.length, 4], [26, name.length]]);
      parts.push(local, name, data);
      central.push(header(46, [[0, 0x02014b50, 4], [4, 20], [6, 20], [8, 0x0800], [10, 0], [16, crc, 4],
        [20, data.length, 4], [24, data.length, 4], [28, name.length], [42, offset, 4]]), name);
      offset += local.length + name.length + data.length;
    }
    var size = central.reduce(function (s, p) { return s + p.length; }, 0);
    var end = header(22, [[0, 0x06054b50, 4], [8, files.length], [10, files.length], [12, size, 4],
      [16, offset, 4]]);
    return new Blob(parts.concat(central, [end]), { type: "application/zip" });
  }

  window.opfuseZip = zip;
})();
